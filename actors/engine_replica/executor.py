"""The Ray executor: one `WorkerActor` per TP rank, every StepPlan sent to all of them.

EngineCore only needs `num_kv_blocks` and `submit(bytes) -> Future`. Rank 0's StepResult is
the answer; the other ranks return None but are waited for too, so a failure on any rank
surfaces. A worker is a plain (one-thread) actor and every plan comes from the engine, so Ray
runs the plans in the order they were submitted, as async scheduling needs.
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.engine_replica.worker import WorkerActor


def worker_bundle(device: str, num_cpus: float) -> dict[str, float]:
    return {"CPU": num_cpus, "GPU": 1.0} if device == "cuda" else {"CPU": num_cpus}


def default_torch_threads(tp: int) -> int:
    # Ranks of one TP group share the node's cores; oversubscribing them stalls gloo.
    return max(1, (os.cpu_count() or 1) // tp)


class RayExecutor:
    def __init__(self, config, pg: PlacementGroup | None = None, first_bundle: int = 1,
                 namespace: str | None = None, *, worker_num_cpus: float,
                 torch_threads: int | None = None, env: dict[str, str] | None = None) -> None:
        tp = config.parallel_config.tensor_parallel_size
        self._owned_pg = None
        if pg is None:  # outside Serve (tests, scripts): a group of our own
            pg = self._owned_pg = placement_group(
                [worker_bundle(config.device, worker_num_cpus)] * tp, strategy="STRICT_PACK")  # one node
            ray.get(pg.ready())
            first_bundle = 0
        gpus = 1 if config.device == "cuda" else 0
        extra = {"runtime_env": {"env_vars": dict(env)}} if env else {}
        self.workers = [
            WorkerActor.options(
                name=f"worker-{rank}", namespace=namespace, num_cpus=worker_num_cpus, num_gpus=gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=first_bundle + rank), **extra).remote()
            for rank in range(tp)]
        init_method = ray.get(self.workers[0].rendezvous_address.remote()) if tp > 1 else None
        threads = torch_threads or default_torch_threads(tp)
        blocks = ray.get([w.init.remote(config, rank, tp, init_method, threads)
                          for rank, w in enumerate(self.workers)])
        # Ranks size their caches alike; the smallest is what every rank can hold.
        self.num_kv_blocks = min(blocks)

    def submit(self, plan_bytes: bytes) -> Future:
        return _all_ranks([w.execute.remote(plan_bytes).future() for w in self.workers])

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """Raises if any worker is dead or does not answer within `timeout_s`. Workers answer
        on a thread of their own, during a step too (actors/engine_replica/worker.py)."""
        await asyncio.wait_for(asyncio.gather(*[w.ping.remote() for w in self.workers]), timeout_s)

    def shutdown(self) -> None:
        for w in self.workers:
            ray.kill(w)
        self.workers = []
        if self._owned_pg is not None:
            remove_placement_group(self._owned_pg)
            self._owned_pg = None


def _all_ranks(ranks: list[Future]) -> Future:
    """Rank 0's result once every rank is done, or the first error any rank raises."""
    out: Future = Future()
    lock = threading.Lock()  # Ray may complete the ranks' futures on different threads

    def settle(_: Future) -> None:
        with lock:
            if out.done():
                return
            failed = next((f for f in ranks if f.done() and f.exception() is not None), None)
            if failed is not None:
                out.set_exception(failed.exception())
            elif all(f.done() for f in ranks):
                out.set_result(ranks[0].result())

    for f in ranks:
        f.add_done_callback(settle)
    return out
