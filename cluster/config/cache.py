"""The paged KV cache: block size, how much memory it takes, its dtype, prefix caching, and the
node-local tier under it (cluster/kv_tier.py: shared memory, then a disk folder)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.config.facts import ModelFacts
from cluster.config.options import Freezable, check_options, option

KV_CACHE_DTYPES = ("auto", "bfloat16")
SHM_TIER_PATH = "/dev/shm/llm-cluster-kv"  # the shared-memory tier's default folder


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: the model's for "auto". Attention reads and writes the cache in
    its own dtype, so only types its kernels take are offered (no fp16 / fp8 on CPU)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else torch.bfloat16


@dataclass
class CacheConfig(Freezable):
    block_size: int = option(16, ge=1, doc="tokens per KV block")
    kv_cache_memory: int | None = option(None, ge=1, nullable=True,
                                         doc="bytes per rank for the cache (default: a share of free memory)")
    gpu_memory_utilization: float = option(0.9, gt=0, le=1, doc="of the GPU's memory, weights and cache together")
    cpu_kv_cache_fraction: float = option(0.25, gt=0, le=1, doc="of free memory for the cache on CPU, at "
                                                                "most 4 GiB, without kv_cache_memory or "
                                                                "VLLM_CPU_KVCACHE_SPACE")
    num_kv_blocks: int | None = option(None, ge=1, nullable=True, doc="the cache's size in blocks (overrides memory)")
    enable_prefix_caching: bool = option(True, boolean=True)
    # vLLM's option. A bf16 cache under an fp32 model is llama.cpp's mix (fp32 activations, 16-bit
    # cache); attention runs in the cache's dtype.
    kv_cache_dtype: str = option("auto", choices=KV_CACHE_DTYPES, doc="auto: the model's dtype")
    # The prefix cache's second tier (docs/kv_tier.md): full prefix blocks written through to files
    # every copy on the node shares, read back instead of prefilled. vLLM's kv_offloading_size (GiB)
    # sizes the shared-memory tier; the disk tier below it is ours. Off unless a size is given.
    kv_offloading_size: float | None = option(None, gt=0, nullable=True,
                                              doc="GiB of shared memory (/dev/shm) for the KV tier (default: off)")
    kv_offloading_shm_path: str = option(SHM_TIER_PATH, doc="the shared-memory tier's folder (a tmpfs)")
    kv_offloading_disk_path: str | None = option(None, nullable=True,
                                                 doc="a folder for the KV tier's disk level (with kv_offloading_disk_size)")
    kv_offloading_disk_size: float | None = option(None, gt=0, nullable=True, doc="GiB for the KV tier's disk level")
    # A resolved config's facts (the same object as model_config.facts); None until then.
    facts: ModelFacts | None = field(default=None, repr=False)

    @property
    def kv_torch_dtype(self) -> torch.dtype | None:
        """The cache's torch dtype, kv_cache_dtype resolved for the model (None before resolution)."""
        return self.facts.kv_torch_dtype if self.facts else None

    @property
    def kv_tier_enabled(self) -> bool:
        return self.kv_offloading_size is not None or self.kv_offloading_disk_path is not None

    def validate(self) -> None:
        check_options(self)
        if (self.kv_offloading_disk_path is None) != (self.kv_offloading_disk_size is None):
            raise ValueError("kv_offloading_disk_path and kv_offloading_disk_size go together, got "
                             f"kv_offloading_disk_path={self.kv_offloading_disk_path!r} and "
                             f"kv_offloading_disk_size={self.kv_offloading_disk_size!r}")
        if self.kv_tier_enabled and not self.enable_prefix_caching:
            raise ValueError("the KV tier (kv_offloading_size / kv_offloading_disk_path) extends the prefix "
                             "cache: it needs enable_prefix_caching=True, got False")
        for name in ("kv_offloading_shm_path", "kv_offloading_disk_path"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must name a folder, got ''")
