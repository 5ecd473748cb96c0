"""A worker: one tensor-parallel rank. Takes StepPlan bytes, returns StepResult bytes (rank 0).

The same class runs in-process (offline `LLM`) and inside a Ray actor (`worker-<rank>`).
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from cluster.config import EngineConfig
from cluster.messages import StepPlan, decode, encode
from cluster.model.parallel import SINGLE, init_distributed
from cluster.worker.model_runner import ModelRunner


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 init_method: str | None = None) -> None:
        if world_size == 1:
            parallel = SINGLE
        else:
            backend = config.parallel_config.distributed_backend
            if backend == "auto":
                backend = "nccl" if config.device == "cuda" else "gloo"
            parallel = init_distributed(rank, world_size, init_method, backend)
        self.rank = rank
        self.runner = ModelRunner(config, parallel)

    @property
    def num_kv_blocks(self) -> int:
        return self.runner.num_blocks

    def execute(self, plan_bytes: bytes) -> bytes | None:
        result = self.runner.execute(decode(plan_bytes, StepPlan))
        return None if result is None else encode(result)


class InProcessExecutor:
    """Runs a single TP=1 worker in this process; the wire format is still exercised.

    Offline (`LLM`), `submit` runs the step before it returns, except with async scheduling on
    CUDA, where the steps run on one worker thread (in order) while the caller plans the next. On
    CPU they stay on the calling thread: torch's OpenMP-parallel ops run 1.5-10x slower per call
    from a thread other than the one that ran the earlier ones (measured: a bf16 64x576 add 6 ->
    66 us, a 64x576x1536 linear 108 -> 204 us; offline throughput 1000 -> 630 tok/s), far more
    than the 1.5-2% of a step the engine's bookkeeping takes.

    `own_thread` (a served copy, `distributed_executor_backend: uni`): the worker is built, and
    every step runs, on one thread of its own (as in a worker actor, one thread does all of the
    model's work), so the caller's event loop goes on during a step; `torch_threads` is set on it."""

    def __init__(self, config: EngineConfig, own_thread: bool = False, torch_threads: int | None = None) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs the Ray executor (actors/), got "
                             f"{config.parallel_config.tensor_parallel_size} in-process")
        overlap = config.scheduler_config.async_scheduling and config.device == "cuda"
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="worker-0") if overlap or own_thread else None
        if own_thread:
            self.worker = self.thread.submit(_build_worker, config, torch_threads).result()
        else:
            self.worker = _build_worker(config, torch_threads)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks

    def submit(self, plan_bytes: bytes) -> Future:
        if self.thread is not None:
            return self.thread.submit(self.worker.execute, plan_bytes)
        done: Future = Future()
        try:
            done.set_result(self.worker.execute(plan_bytes))
        except BaseException as exc:  # handed to the caller through the future, as from a thread
            done.set_exception(exc)
        return done

    async def check_health(self, timeout_s: float = 10.0) -> None:
        """The worker is this process: nothing to ping (a step that hangs is `step_timeout_s`'s)."""

    def shutdown(self) -> None:
        if self.thread is not None:
            self.thread.shutdown(wait=False)


def _build_worker(config: EngineConfig, torch_threads: int | None) -> Worker:
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    return Worker(config)
