"""Tensor-parallel context: which rank this is, the process group, and the collectives the
model runner needs (all-reduce after row-parallel layers, gather of vocab shards to rank 0,
broadcast of rank 0's sampled tokens)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    rank: int
    world_size: int
    group: Any = None  # torch.distributed ProcessGroup, None when world_size == 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def broadcast_from_rank0(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place; same shape and dtype everywhere)."""
        if self.world_size > 1:
            dist.broadcast(x, src=dist.get_global_rank(self.group, 0) if self.group else 0, group=self.group)
        return x

    def gather_to_rank0(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; None on the other ranks."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else None
        # dst is a global rank: the group's first member.
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0) if self.group else 0,
                    group=self.group)
        return torch.cat(parts, dim=dim) if self.rank == 0 else None


SINGLE = ParallelContext(0, 1, None)


def init_distributed(rank: int, world_size: int, init_method: str, backend: str) -> ParallelContext:
    """Join the TP group (gloo on CPU, nccl on CUDA); every rank calls this with the same arguments."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return ParallelContext(rank, world_size, dist.group.WORLD)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tensor_parallel_size={denominator}")
    return numerator // denominator


def local_kv_heads(num_heads: int, num_kv_heads: int, parallel: ParallelContext) -> list[int]:
    """The (global) KV head each of this rank's KV cache heads holds.

    A rank owns q heads [r*q, (r+1)*q). It keeps one KV head per run of `gcd(q, group)`
    consecutive q heads, so its local heads form a uniform GQA grouping. When the KV heads
    split evenly this is the plain split; with fewer KV heads than ranks (or a split that
    does not line up, e.g. 3 KV heads on 2 ranks) some KV heads are replicated.
    """
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    q_local = divide(num_heads, parallel.world_size, "num_attention_heads")
    group = num_heads // num_kv_heads
    run = math.gcd(q_local, group)
    first = parallel.rank * q_local
    return [(first + j * run) // group for j in range(q_local // run)]
