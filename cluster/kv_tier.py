"""The prefix cache's second tier: full prefix blocks in files every copy on the node shares.

The pool (cluster/engine/block_manager.py) drops its least recently used prefix blocks when it
fills; a conversation's next turn would then be prefilled again. Under it, each full block is
written to a node-local store, keyed by its chain hash (cluster/prefix_hash.py: the whole prefix
and the LoRA adapter's salt are in it), and a prompt that misses the pool but hits the store has
those blocks read back into fresh pool blocks instead of computed.

Writes are write-through: every block the pool registers is written in the step that completes
it (by a background thread of each worker, off the step loop), not when the pool evicts it. So a
copy that crashes or restarts, and every other copy on the node, finds the prefix in the store
although no pool ever evicted it, and an eviction costs nothing. (A store too small for the
conversations cycling through it stops taking writes while they are not read back:
cluster/engine/tier_planner.py.)

Layout: `<level>/<namespace>/<chain hash>.<rank>.kv`, levels shared memory first (a tmpfs such as
/dev/shm), then an optional disk folder, each with a byte budget kept by LRU (a read touches the
file's mtime): the shared-memory level spills its oldest files to disk, the last level deletes
them. The namespace is a digest of everything that gives a block's bytes their meaning (the model
and its weight files, dtypes, block size, the cache layout, the TP size), so files of another
model or layout are never even looked at. Each TP rank writes and reads its own heads' file.

Crash safety: a file is written under a temporary name in the same folder and renamed into place
(os.replace: readers see all of it or nothing); its header names namespace, hash, rank and tokens,
and an xxh3 checksum covers header, tokens and payload, so a torn, foreign or rotten file is
skipped, counted and removed. Two copies writing one block is harmless: the content is the same,
a writer skips a block that exists, and the rename is atomic. There is no fsync: after a power
loss the checksum catches what the disk lost.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import struct
import threading
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import xxhash

from cluster.messages import KVTierCounters

MAGIC = b"LCKV"
FORMAT_VERSION = 1
# magic, version, namespace, chain hash, rank, TP size, tokens, payload bytes; then the tokens
# (int32) and zeros up to a multiple of ALIGN (the payload is read in place as floats), the
# payload, and an xxh3-64 of everything before it.
_HEADER = struct.Struct("<4sH16s16sHHIQ")
ALIGN = 64
_CHECKSUM = struct.Struct("<Q")
SUFFIX = ".kv"
GIB = 1 << 30
LOW_WATER = 0.9  # an over-budget level is cut to this share of its budget (fewer scans)
STALE_TMP_S = 600.0  # a temporary file this old was left by a writer that died
LIST_PERIOD_S = 1.0  # routing_keys lists the folders again at most this often (a router reads them each second)


@dataclass
class TierLevel:
    path: Path  # this level's namespace folder
    budget: int  # bytes
    usage: int = -1  # bytes at the last scan plus what this process wrote since (-1: not scanned)
    since_scan: int = 0  # bytes this process wrote here since the last scan


def namespace(config: Any) -> bytes:
    """16 bytes naming what a block's bytes mean (a finalized EngineConfig): the model (its path and
    weight files, dummy weights' seed), dtypes, block size, the KV layout and the TP size."""
    from cluster.model.models.llama import head_dim_of

    mc, cc, hf = config.model_config, config.cache_config, config.model_config.hf_config
    ident = {
        "format": FORMAT_VERSION, "layout": "layer, K|V, token, kv head, head dim",
        "model": str(Path(mc.path).resolve()), "weights": _weights_fingerprint(mc.path),
        "load_format": mc.load_format, "seed": mc.seed if mc.load_format == "dummy" else None,
        "quantization": mc.quantization, "dtype": str(mc.torch_dtype), "kv_dtype": str(cc.kv_torch_dtype),
        "block_size": cc.block_size, "layers": hf.num_hidden_layers, "heads": hf.num_attention_heads,
        "kv_heads": hf.num_key_value_heads, "head_dim": head_dim_of(hf),
        "tp": config.parallel_config.tensor_parallel_size,
    }
    return xxhash.xxh3_128_digest(json.dumps(ident, sort_keys=True).encode())


def _weights_fingerprint(path: str) -> list[tuple[str, int, int]]:
    """(name, size, mtime) of the weight files: the same folder with other weights is another model."""
    p = Path(path)
    files = [p] if p.is_file() else sorted(f for f in p.glob("*") if f.suffix in (".safetensors", ".bin", ".gguf", ".pt"))
    return [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]


def file_name(chain_hash: int, rank: int) -> str:
    return f"{chain_hash:032x}.{rank}{SUFFIX}"


class TierStore:
    """One process's handle on the node's store for one namespace: `contains` for the engine,
    `read` / `write` for a rank. Thread-safe (a worker writes from a background thread)."""

    def __init__(self, levels: Sequence[tuple[str | Path, int]], namespace_digest: bytes,
                 world_size: int = 1, rank: int = 0) -> None:
        if not levels:
            raise ValueError("levels must name at least one (folder, budget in bytes), got none")
        self.ns, self.world_size, self.rank = namespace_digest, world_size, rank
        self.levels = []
        for path, budget in levels:
            if budget < 1:
                raise ValueError(f"a KV tier level's budget must be at least 1 byte, got {budget} for {path}")
            folder = Path(path) / namespace_digest.hex()
            folder.mkdir(parents=True, exist_ok=True)
            self.levels.append(TierLevel(folder, int(budget)))
        self.counters = KVTierCounters()
        self._lock = threading.Lock()
        # when (-inf: never, so the first routing_keys call lists), stamps, version, keys
        self._listing: tuple[float, list[int], int, list[int]] = (-math.inf, [], 0, [])
        self._relisting = threading.Lock()  # held while a background listing runs

    @classmethod
    def from_config(cls, config: Any, rank: int = 0) -> "TierStore | None":
        """The store a finalized EngineConfig asks for, or None when the tier is off."""
        cc = config.cache_config
        if not cc.kv_tier_enabled:
            return None
        levels, names = [], []
        if cc.kv_offloading_size is not None:
            levels.append((cc.kv_offloading_shm_path, int(cc.kv_offloading_size * GIB)))
            names.append("kv_offloading_shm_path")
        if cc.kv_offloading_disk_path is not None:
            levels.append((cc.kv_offloading_disk_path, int(cc.kv_offloading_disk_size * GIB)))
            names.append("kv_offloading_disk_path")
        for name, (path, _) in zip(names, levels):
            try:
                Path(path).mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(f"{name}={path!r}: the KV tier cannot use this folder ({exc})") from exc
        return cls(levels, namespace(config), config.parallel_config.tensor_parallel_size, rank)

    @property
    def budget(self) -> int:
        """Bytes the levels hold together (a file spilled from one level lands in the next)."""
        return sum(level.budget for level in self.levels)

    # ---- lookups ------------------------------------------------------------------------
    def _find(self, name: str) -> Path | None:
        for level in self.levels:
            path = level.path / name
            if path.exists():
                return path
        return None

    def contains(self, chain_hash: int) -> bool:
        """Whether every rank's file of the block is in some level (a few stats; no read)."""
        return all(self._find(file_name(chain_hash, r)) is not None for r in range(self.world_size))

    def level_of(self, chain_hash: int) -> int | None:
        """The slowest level holding one of the block's rank files (0: all in the first), or None
        if some rank's file is missing."""
        worst = 0
        for r in range(self.world_size):
            name = file_name(chain_hash, r)
            level = next((i for i, lv in enumerate(self.levels) if (lv.path / name).exists()), None)
            if level is None:
                return None
            worst = max(worst, level)
        return worst

    def routing_keys(self, limit: int | None = None) -> tuple[int, list[int]]:
        """(version, keys) of the last listing (`relist`), `limit` keys at most, without waiting:
        when that listing is LIST_PERIOD_S old, a background thread lists the folders again, so a
        caller on a serving loop never waits on a directory of many thousand files. The first
        calls answer (0, [])."""
        listed_at, _, version, keys = self._listing
        if time.monotonic() - listed_at >= LIST_PERIOD_S and self._relisting.acquire(blocking=False):
            threading.Thread(target=self._relist_in_background, name="kv-tier-list", daemon=True).start()
        return version, keys[:limit]

    def relist(self) -> tuple[int, list[int]]:
        """List the store now: (version, keys), the routing keys (cluster/prefix_hash.py) of the
        blocks every rank's file of which some level holds, most recently used first, for a
        router, which counts them as cheaper to serve than a miss on every copy sharing the store.
        The folders are read only when one of them changed since the last listing (a folder's
        mtime moves when a file is added, renamed or removed); `version` moves only when the keys
        do. Files other processes write or evict are seen at the next listing."""
        _, stamps, version, keys = self._listing
        new_stamps = [_mtime_ns(level.path) for level in self.levels]
        if new_stamps != stamps:
            new_keys = self._list_keys()
            if new_keys != keys:
                version, keys = version + 1, new_keys
        self._listing = (time.monotonic(), new_stamps, version, keys)
        return version, keys

    def _relist_in_background(self) -> None:
        try:
            self.relist()
        except OSError:  # a folder gone meanwhile: keep the last listing, try again next period
            self._listing = (time.monotonic(), *self._listing[1:])
        finally:
            self._relisting.release()

    def _list_keys(self) -> list[int]:
        ranks: dict[str, set[str]] = {}  # chain hash (hex) -> its rank files found (a file may be in two levels)
        newest: dict[str, int] = {}  # chain hash (hex) -> the newest mtime of its files
        for level in self.levels:
            for mtime, _, name in self._scan(level):
                h = name[:32]
                ranks.setdefault(h, set()).add(name)
                newest[h] = max(newest.get(h, 0), mtime)
        whole = sorted((h for h, files in ranks.items() if len(files) >= self.world_size),
                       key=newest.__getitem__, reverse=True)
        return [int(h[16:], 16) for h in whole]  # a routing key: the hash's low 64 bits

    def promote(self, chain_hash: int) -> bool:
        """Copy every rank's file of the block found below the first level into it (kept below
        too: the disk copy outlives a reboot), so a step reads it at memory speed. Whether all
        rank files are in the first level now."""
        ok = True
        for r in range(self.world_size):
            name = file_name(chain_hash, r)
            top = self.levels[0].path / name
            src = next((lv.path / name for lv in self.levels[1:] if (lv.path / name).exists()), None)
            if top.exists() or src is None:
                ok = ok and top.exists()
                continue
            tmp = top.with_name(f".{name}.{os.getpid()}.{threading.get_ident()}.tmp")
            try:
                size = src.stat().st_size
                shutil.copyfile(src, tmp)
                os.replace(tmp, top)  # its mtime is now: just used
            except OSError:  # gone meanwhile, or the first level is full: read from below
                tmp.unlink(missing_ok=True)
                ok = False
                continue
            self._account(0, size)
        return ok

    def read(self, chain_hash: int, token_ids: Sequence[int]) -> memoryview | None:
        """This rank's payload of the block (writable), or None: not there, or a file that fails
        a check (counted and removed). A hit becomes the level's most recently used file."""
        name = file_name(chain_hash, self.rank)
        for level in self.levels:
            path = level.path / name
            try:
                with open(path, "rb") as f:
                    data = bytearray(os.fstat(f.fileno()).st_size)
                    n = f.readinto(data)
            except FileNotFoundError:
                continue
            payload = self._check(data[:n] if n < len(data) else data, chain_hash, token_ids)
            if payload is None:
                self._drop_bad(path)
                return None
            try:
                os.utime(path)
            except FileNotFoundError:  # evicted meanwhile: the bytes in hand are still good
                pass
            with self._lock:
                self.counters.bytes_read += len(data)
            return payload
        return None

    def _check(self, data: bytearray, chain_hash: int, token_ids: Sequence[int]) -> memoryview | None:
        hs = _HEADER.size
        if len(data) < hs + _CHECKSUM.size:
            return None
        magic, version, ns, h, rank, world, num_tokens, payload_len = _HEADER.unpack_from(data)
        start = _payload_offset(num_tokens)
        if (magic, version, ns, rank, world) != (MAGIC, FORMAT_VERSION, self.ns, self.rank, self.world_size) \
                or h != chain_hash.to_bytes(16, "little") or len(data) != start + payload_len + _CHECKSUM.size:
            return None
        view = memoryview(data)
        (digest,) = _CHECKSUM.unpack_from(data, start + payload_len)
        if xxhash.xxh3_64_intdigest(view[:start + payload_len]) != digest:
            return None
        tokens = array("i")
        tokens.frombytes(view[hs:hs + 4 * num_tokens])
        if tokens.tolist() != list(token_ids):
            return None
        return view[start:start + payload_len]

    def _drop_bad(self, path: Path) -> None:
        with self._lock:
            self.counters.corrupt_files += 1
        try:
            path.unlink()
        except FileNotFoundError:
            pass

    # ---- writes -----------------------------------------------------------------------------
    def write(self, chain_hash: int, token_ids: Sequence[int], payload: memoryview | bytes) -> bool:
        """Write this rank's payload of the block to the first level, unless it is already in
        the store. Returns whether it was written. Keeps the levels within their budgets."""
        name = file_name(chain_hash, self.rank)
        if self._find(name) is not None:  # written by another copy, or before a restart
            return False
        level = self.levels[0]
        header = _HEADER.pack(MAGIC, FORMAT_VERSION, self.ns, chain_hash.to_bytes(16, "little"), self.rank,
                              self.world_size, len(token_ids), len(payload)) + array("i", token_ids).tobytes()
        header += bytes(_payload_offset(len(token_ids)) - len(header))
        digest = xxhash.xxh3_64(header)
        digest.update(payload)
        tmp = level.path / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
                f.write(_CHECKSUM.pack(digest.intdigest()))
            os.replace(tmp, level.path / name)
        except OSError:  # a full or vanished folder: the block is just not stored
            tmp.unlink(missing_ok=True)
            return False
        size = len(header) + len(payload) + _CHECKSUM.size
        with self._lock:
            self.counters.bytes_written += size
            self.counters.blocks_written += 1
        self._account(0, size)
        return True

    # ---- budgets ------------------------------------------------------------------------------
    def _account(self, i: int, nbytes: int) -> None:
        """Book `nbytes` new in level i; scan it when it may be over budget. Other processes' writes
        are seen only by a scan, so one also runs after each eighth of the budget written here."""
        level = self.levels[i]
        level.since_scan += nbytes
        if level.usage >= 0:
            level.usage += nbytes
        if level.usage < 0 or level.usage > level.budget or level.since_scan > level.budget // 8:
            self.shrink(i)

    def shrink(self, i: int = 0) -> None:
        """Scan level i and, if it is over budget, move its least recently used files down a level
        (or delete them from the last) until it is under LOW_WATER of it."""
        level = self.levels[i]
        files = self._scan(level)
        total = sum(size for _, size, _ in files)
        level.since_scan = 0
        if total > level.budget:
            for _, size, name in sorted(files):
                if total <= level.budget * LOW_WATER:
                    break
                if i + 1 < len(self.levels):
                    self._spill(i, name)
                else:
                    self._evict(level.path / name)
                total -= size
        level.usage = total

    def _scan(self, level: TierLevel) -> list[tuple[int, int, str]]:
        """(mtime, size, name) of the level's block files; stale temporary files are removed."""
        files, now = [], time.time()
        with os.scandir(level.path) as it:
            for entry in it:
                try:
                    st = entry.stat()
                except FileNotFoundError:
                    continue
                if entry.name.endswith(SUFFIX):
                    files.append((st.st_mtime_ns, st.st_size, entry.name))
                elif entry.name.endswith(".tmp") and now - st.st_mtime > STALE_TMP_S:
                    Path(entry.path).unlink(missing_ok=True)
        return files

    def _evict(self, path: Path) -> None:
        try:
            path.unlink()
        except FileNotFoundError:
            return  # another process evicted it first
        with self._lock:
            self.counters.evictions += 1

    def _spill(self, i: int, name: str) -> None:
        """Move a file from level i to level i + 1 (another filesystem: copy, rename, then unlink,
        so a reader always finds it in one of them), keeping its mtime: LRU across both levels."""
        src, below = self.levels[i].path / name, self.levels[i + 1]
        dst, tmp = below.path / name, below.path / f".{name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            if not dst.exists():
                shutil.copyfile(src, tmp)
                st = src.stat()
                os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
                os.replace(tmp, dst)
                size = st.st_size
            else:
                size = 0
            src.unlink()
        except FileNotFoundError:  # evicted or spilled by another process meanwhile
            tmp.unlink(missing_ok=True)
            return
        except OSError:  # the disk refused it: drop the file instead
            tmp.unlink(missing_ok=True)
            self._evict(src)
            return
        with self._lock:
            self.counters.spills += 1
        if size:
            self._account(i + 1, size)

    def snapshot(self) -> KVTierCounters:
        with self._lock:
            c = self.counters
            return msgspec.structs.replace(c)

    def count(self, name: str, value: float) -> None:
        """Add `value` to one of the counters (those the worker keeps: load time, dropped writes)."""
        with self._lock:
            setattr(self.counters, name, getattr(self.counters, name) + value)


def _mtime_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns  # a folder's changes when a file is added, renamed or removed
    except FileNotFoundError:
        return -1


def _payload_offset(num_tokens: int) -> int:
    return -(-(_HEADER.size + 4 * num_tokens) // ALIGN) * ALIGN
