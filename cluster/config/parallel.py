"""Tensor parallelism: ranks per model copy, their collective backend, and where a served copy's
ranks run."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config.options import Freezable, check_options, option

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")
EXECUTOR_BACKENDS = ("ray", "uni")  # vLLM's names: a worker process per rank, or the engine's own process


@dataclass
class ParallelConfig(Freezable):
    tensor_parallel_size: int = option(1, ge=1, doc="ranks (GPUs, or CPU worker processes) per model copy")
    distributed_backend: str = option("auto", choices=DISTRIBUTED_BACKENDS, doc="auto: gloo on CPU, nccl on CUDA")
    distributed_executor_backend: str | None = option(
        None, choices=EXECUTOR_BACKENDS, nullable=True,
        doc="where a served copy's ranks run: ray (a worker actor each) or uni (one rank on CPU, in the "
            "engine replica's process); default uni where it applies, else ray")

    def validate(self) -> None:
        check_options(self)
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size != 1:
            raise ValueError("distributed_executor_backend='uni' runs the one rank in the engine's process: "
                             f"tensor_parallel_size must be 1, got {self.tensor_parallel_size}")

    def resolve_executor(self, device: str) -> None:
        """The executor backend for `device` where none was given (on finalize's copy). `uni` is
        the default at one rank on CPU: a step then costs no Ray call and the copy no second
        process (docs/deploying.md). On CUDA the engine replica holds no GPU, so its ranks are
        worker actors."""
        if self.distributed_executor_backend == "uni" and device != "cpu":
            raise ValueError(f"distributed_executor_backend='uni' is for the CPU (device {device!r}): the "
                             "engine replica holds no GPU; use 'ray'")
        if self.distributed_executor_backend is None:
            self.distributed_executor_backend = "uni" if self.tensor_parallel_size == 1 and device == "cpu" else "ray"
