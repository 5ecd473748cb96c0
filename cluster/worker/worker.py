"""A worker: one tensor-parallel rank. Takes StepPlan bytes, returns StepResult bytes (rank 0).

The same class runs in-process (offline `LLM`) and inside a Ray actor (`worker-<rank>`).
"""
from __future__ import annotations

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
    """Runs a single TP=1 worker in this process; the wire format is still exercised."""

    def __init__(self, config: EngineConfig) -> None:
        if config.parallel_config.tensor_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 needs the Ray executor (actors/), got "
                             f"{config.parallel_config.tensor_parallel_size} in-process")
        self.worker = Worker(config)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_kv_blocks

    def execute(self, plan_bytes: bytes) -> bytes | None:
        return self.worker.execute(plan_bytes)

    async def execute_async(self, plan_bytes: bytes) -> bytes | None:
        return self.execute(plan_bytes)
