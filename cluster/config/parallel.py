"""Tensor parallelism: ranks per model copy and their collective backend."""
from __future__ import annotations

from dataclasses import dataclass

from cluster.config.options import Freezable, check_options, option

DISTRIBUTED_BACKENDS = ("auto", "gloo", "nccl")


@dataclass
class ParallelConfig(Freezable):
    tensor_parallel_size: int = option(1, ge=1, doc="ranks (GPUs, or CPU worker processes) per model copy")
    distributed_backend: str = option("auto", choices=DISTRIBUTED_BACKENDS, doc="auto: gloo on CPU, nccl on CUDA")

    def validate(self) -> None:
        check_options(self)
