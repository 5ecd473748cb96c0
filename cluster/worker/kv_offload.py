"""One rank's side of the KV tier (cluster/kv_tier.py): this rank's heads of full blocks copied
out of its KV cache into the node's store, and back in.

Per step (`ModelRunner.execute`): the plan's `kv_loads` (blocks of requests starting in this
step) go to reader threads at once; before the forward every rank waits for its reads, the
ranks agree which loads every one of them read (an all-reduce), and those are copied in. A load
some rank could not read is handed back to the model runner, which computes its blocks before
the forward, so the step's plan holds either way. After the forward the blocks of `kv_saves`
(which it just completed) are copied out at once, since a later step may reuse them, and
written by a writer thread, off the step loop.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from cluster.config import EngineConfig
from cluster.kv_tier import TierStore
from cluster.messages import KVBlock, KVLoad, KVTierCounters, StepPlan, StepResult
from cluster.model.parallel import ParallelContext

logger = logging.getLogger(__name__)

# Host copies waiting for the writer beyond this are dropped (not stored): a slow disk must not
# grow the worker's memory without bound. (One step's saves always go when none wait.)
MAX_PENDING_WRITE_BYTES = 512 << 20
READ_THREADS = 2  # files read at once (the reads of one step's loads overlap)


class KVOffload:
    def __init__(self, store: TierStore, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                 parallel: ParallelContext) -> None:
        self.store, self.caches, self.parallel = store, kv_caches, parallel
        k = kv_caches[0][0]
        self.block_shape = (len(kv_caches), 2, *k.shape[1:])  # layer, K|V, token, kv head, head dim
        self.block_bytes = k[0].numel() * k.element_size() * 2 * len(kv_caches)
        self.dtype, self.device = k.dtype, k.device
        self.reader = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-tier-reader")
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-writer")
        self.reads: list[tuple[KVLoad, Future]] = []  # this step's, in plan order (every rank's)
        self.loaded: list[int] = []  # this step's load ids read in, and failed on some rank
        self.failed: list[int] = []
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
        """Read and check the loads' files in the background (while the step's inputs are set up)."""
        self.reads = [(load, self.reader.submit(self._read, load)) for load in loads]

    def finish_loads(self) -> list[KVLoad]:
        """Before the forward: wait for this step's reads and copy in those every rank read.
        Returns the loads some rank could not read (every rank returns the same ones): their
        blocks must be computed before the forward."""
        reads, self.reads = self.reads, []
        payloads = [fut.result() for _, fut in reads]
        bad = [p is None for p in payloads]
        if self.parallel.world_size > 1:  # every rank decides the same
            bad = self.parallel.all_reduce(torch.tensor(bad, dtype=torch.int32, device=self.device)).tolist()
        good = [(block, data) for (load, _), p, b in zip(reads, payloads, bad) if not b
                for block, data in zip(load.blocks, p)]
        if good:
            self._copy_in(good)
        self.loaded = [load.load_id for (load, _), b in zip(reads, bad) if not b]
        self.failed = [load.load_id for (load, _), b in zip(reads, bad) if b]
        return [load for (load, _), b in zip(reads, bad) if b]

    def finish_step(self, plan: StepPlan, result: StepResult | None) -> StepResult | None:
        """After the step's forward: copy the saves out; put the step's loads (read in, or
        computed) and rank 0's changed counters into rank 0's result."""
        if plan.kv_saves:
            self._save(plan.kv_saves)
        if result is not None:
            result.kv_loaded, result.kv_load_failed = self.loaded, self.failed
            counters = self.store.snapshot()
            if counters != self._reported:
                result.kv_tier = self._reported = counters
        self.loaded, self.failed = [], []
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
