"""The paged KV cache: block size, how much memory it takes, its dtype, prefix caching."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.config.options import check_options, option

KV_CACHE_DTYPES = ("auto", "bfloat16")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype: the model's for "auto". Attention reads and writes the cache in
    its own dtype, so only types its kernels take are offered (no fp16 / fp8 on CPU)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
    return model_dtype if kv_cache_dtype == "auto" else torch.bfloat16


@dataclass
class CacheConfig:
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
    kv_torch_dtype: torch.dtype | None = None  # learned by finalize

    def validate(self) -> None:
        check_options(self)
