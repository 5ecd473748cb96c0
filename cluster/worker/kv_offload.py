"""One rank's side of the KV tier (cluster/kv_tier.py): this rank's heads of full blocks copied
out of its KV cache into the node's store, and back in.

Per step (`ModelRunner.execute`): the files of the plan's `kv_loads` go to a reader thread, which
reads and checks them while this and later steps run; after the forward the blocks of `kv_saves`
(which the forward just completed) are copied out at once, since a later step may reuse them, and
written by a writer thread, off the step loop. Then every load whose read is done on every rank
(the ranks agree by an all-reduce while any is pending) is copied in and reported in the result,
or reported failed if a rank could not read it: the engine computes those blocks instead. A
load's blocks are held for a waiting request that no step reads before the engine has that
report, and the engine frees them only after it, so copying them in at any step's end is safe.
A step with nothing else to do waits a little for the oldest read.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from cluster.config import EngineConfig
from cluster.kv_tier import TierStore
from cluster.messages import KVBlock, KVLoad, KVTierCounters, StepPlan, StepResult
from cluster.model.parallel import ParallelContext

logger = logging.getLogger(__name__)

# Host copies waiting for the writer beyond this are dropped (not stored): a slow disk must not
# grow the worker's memory without bound. (One step's saves always go when none wait.)
MAX_PENDING_WRITE_BYTES = 512 << 20
# A step with nothing but reads out waits this long for the oldest one: the engine then plans
# again (new requests get in) instead of spinning or blocking on a slow disk.
POLL_WAIT_S = 0.05


class KVOffload:
    def __init__(self, store: TierStore, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 parallel: ParallelContext) -> None:
        self.store, self.caches, self.parallel = store, kv_caches, parallel
        k = kv_caches[0][0]
        self.block_shape = (len(kv_caches), 2, *k.shape[1:])  # layer, K|V, token, kv head, head dim
        self.block_bytes = k[0].numel() * k.element_size() * 2 * len(kv_caches)
        self.dtype, self.device = k.dtype, k.device
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-reader")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-writer")
        self.pending: dict[int, tuple[KVLoad, Future]] = {}  # load id -> read, in plan order (every rank's)
        self.writes: list[Future] = []
        self.pending_bytes = 0
        self._lock = threading.Lock()
        self._reported: KVTierCounters | None = None

    @classmethod
    def create(cls, config: EngineConfig, parallel: ParallelContext,
               kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> "KVOffload | None":
        store = TierStore.from_config(config, parallel.rank)
        return None if store is None else cls(store, kv_caches, parallel)

    # ---- the step -------------------------------------------------------------------------
    def start_loads(self, loads: list[KVLoad]) -> None:
        """Read and check the loads' files in the background (beside this and later forwards)."""
        for load in loads:
            self.pending[load.load_id] = (load, self.reader.submit(self._read, load))

    def finish_step(self, plan: StepPlan, result: StepResult | None) -> StepResult | None:
        """After the step's forward: copy the saves out and the finished loads in; put the loads
        done (or failed) on every rank and rank 0's changed counters into rank 0's result."""
        if plan.kv_saves:
            self._save(plan.kv_saves)
        loaded, failed = self._poll(block=not plan.num_scheduled_tokens) if self.pending else ([], [])
        if result is not None:
            result.kv_loaded, result.kv_load_failed = loaded, failed
            counters = self.store.snapshot()
            if counters != self._reported:
                result.kv_tier = self._reported = counters
        return result

    def flush(self) -> None:
        """Wait for every write handed to the writer so far (tests; a clean shutdown)."""
        with self._lock:
            writes, self.writes = self.writes, []
        for fut in writes:
            fut.result()

    # ---- loads ----------------------------------------------------------------------------
    def _read(self, load: KVLoad) -> list[memoryview] | None:
        """The load's payloads, or None if any block is missing or fails its checks."""
        start = time.perf_counter()
        try:
            out = []
            for block in load.blocks:
                payload = self.store.read(int.from_bytes(block.chain_hash, "little"), block.token_ids)
                if payload is None or len(payload) != self.block_bytes:
                    return None
                out.append(payload)
            return out
        except Exception:  # an unreadable folder, say: the blocks are computed instead
            logger.exception("rank %d: reading KV tier blocks failed", self.parallel.rank)
            return None
        finally:
            self.store.count("load_seconds", time.perf_counter() - start)

    def _poll(self, block: bool) -> tuple[list[int], list[int]]:
        """(loaded, failed) load ids among those whose read is done on every rank; the loaded
        ones are copied in. With `block`, the oldest read is waited for first (a while)."""
        items = list(self.pending.items())
        if block:
            wait([items[0][1][1]], timeout=POLL_WAIT_S)
        done = [fut.done() for _, (_, fut) in items]
        flags = torch.tensor([[d, d and fut.result() is None] for d, (_, (_, fut)) in zip(done, items)],
                             dtype=torch.int32, device=self.device)
        flags = self.parallel.all_reduce(flags).tolist()  # every rank decides the same
        loaded, failed, payloads = [], [], []
        for (load_id, (load, fut)), (ranks_done, bad) in zip(items, flags):
            if ranks_done < self.parallel.world_size:
                continue
            del self.pending[load_id]
            if bad:  # some rank could not read it: nobody copies it in
                failed.append(load_id)
            else:
                loaded.append(load_id)
                payloads += zip(load.blocks, fut.result())
        if payloads:
            self._copy_in(payloads)
        return loaded, failed

    def _copy_in(self, payloads: list[tuple[KVBlock, memoryview]]) -> None:
        start = time.perf_counter()
        parts = [torch.frombuffer(p, dtype=self.dtype).view(self.block_shape) for _, p in payloads]
        blocks = torch.stack(parts).to(self.device)  # [n, layer, K|V, token, head, dim]
        index = torch.tensor([b.block_id for b, _ in payloads], device=self.device)
        for layer, (k, v) in enumerate(self.caches):
            k.index_copy_(0, index, blocks[:, layer, 0])
            v.index_copy_(0, index, blocks[:, layer, 1])
        self.store.count("load_seconds", time.perf_counter() - start)

    # ---- saves ------------------------------------------------------------------------------
    def _save(self, blocks: list[KVBlock]) -> None:
        nbytes = len(blocks) * self.block_bytes
        with self._lock:
            self.writes = [f for f in self.writes if not f.done()]
            if self.pending_bytes and self.pending_bytes + nbytes > MAX_PENDING_WRITE_BYTES:
                self.store.count("writes_dropped", len(blocks))
                return
            self.pending_bytes += nbytes
        index = torch.tensor([b.block_id for b in blocks], device=self.device)
        host = torch.empty((len(blocks), *self.block_shape), dtype=self.dtype, device=self.device)
        for layer, (k, v) in enumerate(self.caches):
            host[:, layer, 0] = k.index_select(0, index)
            host[:, layer, 1] = v.index_select(0, index)
        host = host.cpu()  # a block may be reused by the next step: copy it now, write it later
        fut = self.writer.submit(self._write, blocks, host, nbytes)
        with self._lock:
            self.writes.append(fut)

    def _write(self, blocks: list[KVBlock], host: torch.Tensor, nbytes: int) -> None:
        try:
            raw = host.view(torch.uint8).numpy()
            for block, payload in zip(blocks, raw):
                self.store.write(int.from_bytes(block.chain_hash, "little"), block.token_ids,
                                 memoryview(payload.reshape(-1)))
        except Exception:  # a block not stored is only a later miss; never fail the worker
            logger.exception("rank %d: writing %d KV blocks to the tier failed", self.parallel.rank, len(blocks))
        finally:
            with self._lock:
                self.pending_bytes -= nbytes
