"""One rank's side of the KV tier (cluster/kv_tier.py): this rank's heads of full blocks copied
out of its KV cache into the node's store, and back in.

Per step (`ModelRunner.execute`): the files of the plan's `kv_loads` are read and checked by a
reader thread while the forward runs; after the forward the blocks of `kv_saves` (which the
forward just completed) are copied out at once, since a later step may reuse them, and written by
a writer thread, off the step loop; then the loads are copied in. A load's blocks belong to a
waiting request that no step reads before the engine has this step's result, so copying them in
after the forward is safe, and a read that failed on any rank (the ranks agree by an all-reduce)
is reported in the result: the engine then computes those blocks instead.
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
# grow the worker's memory without bound.
MAX_PENDING_WRITE_BYTES = 512 << 20


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
    def start_loads(self, loads: list[KVLoad]) -> list[Future]:
        """Read and check the loads' files in the background (while the forward runs)."""
        return [self.reader.submit(self._read, load) for load in loads]

    def finish_step(self, plan: StepPlan, reads: list[Future], result: StepResult | None) -> StepResult | None:
        """After the step's forward: copy the saves out, the loads in, and put the loads that
        failed on any rank and rank 0's changed counters into rank 0's result."""
        if plan.kv_saves:
            self._save(plan.kv_saves)
        failed = self._finish_loads(plan.kv_loads, reads) if plan.kv_loads else []
        if result is not None:
            result.kv_load_failed = failed
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
        start = time.perf_counter()
        try:
            out = []
            for block in load.blocks:
                payload = self.store.read(int.from_bytes(block.chain_hash, "little"), block.token_ids)
                if payload is None or len(payload) != self.block_bytes:
                    return None
                out.append(payload)
            return out
        finally:
            self.store.count("load_seconds", time.perf_counter() - start)

    def _finish_loads(self, loads: list[KVLoad], reads: list[Future]) -> list[str]:
        start = time.perf_counter()
        ok = [fut.result() for fut in reads]
        ids = [b.block_id for load, payloads in zip(loads, ok) if payloads is not None for b in load.blocks]
        if ids:
            parts = [torch.frombuffer(p, dtype=self.dtype).view(self.block_shape)
                     for payloads in ok if payloads is not None for p in payloads]
            blocks = torch.stack(parts).to(self.device)  # [n, layer, K|V, token, head, dim]
            index = torch.tensor(ids, device=self.device)
            for layer, (k, v) in enumerate(self.caches):
                k.index_copy_(0, index, blocks[:, layer, 0])
                v.index_copy_(0, index, blocks[:, layer, 1])
        failed = torch.tensor([payloads is None for payloads in ok], dtype=torch.int32, device=self.device)
        failed = self.parallel.all_reduce(failed).tolist()  # a block any rank lacks is computed instead
        self.store.count("load_seconds", time.perf_counter() - start)
        return [load.req_id for load, bad in zip(loads, failed) if bad]

    # ---- saves ------------------------------------------------------------------------------
    def _save(self, blocks: list[KVBlock]) -> None:
        nbytes = len(blocks) * self.block_bytes
        with self._lock:
            self.writes = [f for f in self.writes if not f.done()]
            if self.pending_bytes + nbytes > MAX_PENDING_WRITE_BYTES:
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
