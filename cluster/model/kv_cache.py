"""Paged KV cache allocation: per layer one K and one V tensor of shape
[num_blocks, block_size, num_local_kv_heads, head_dim], attached to each Attention layer.

On CPU the cache asks Linux for transparent huge pages (2 MB) before its memory is first
touched. Decode attention reads every block of every running sequence each step, and once the
prefix cache has churned a sequence's blocks lie anywhere in gigabytes of cache: with 4 KB pages
nearly every block read misses the TLB."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cluster.model.huge_pages import zeros_on_huge_pages
from cluster.model.layers.attention import Attention, make_backend, select_backend
from cluster.model.models.llama import head_dim_of
from cluster.model.parallel import ParallelContext, local_kv_heads


def kv_cache_bytes_per_block(hf_config: Any, parallel: ParallelContext, block_size: int,
                             dtype: torch.dtype) -> int:
    """Bytes one block takes on this rank across all layers (K and V)."""
    kv_heads = len(local_kv_heads(hf_config.num_attention_heads, hf_config.num_key_value_heads, parallel))
    per_layer = 2 * block_size * kv_heads * head_dim_of(hf_config) * dtype.itemsize
    return per_layer * hf_config.num_hidden_layers


def bind_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                  device: torch.device | str, attention_backend: str | None = None
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Allocate every layer's (K, V) cache, attach it to the layer, and resolve the attention
    backend (the one given, else the one `load_model` was asked for). Zero-filled: padded
    key slots are masked out, and 0 * garbage could still be NaN."""
    if num_blocks < 1 or block_size < 1:
        raise ValueError(f"num_blocks and block_size must be >= 1, got {num_blocks} and {block_size}")
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no Attention layers to bind a KV cache to")
    name = select_backend(attention_backend or layers[0].backend_name, device, block_size, dtype)
    backend = make_backend(name)
    caches = []
    cpu = torch.device(device).type == "cpu"

    def zeros(shape: tuple[int, ...]) -> torch.Tensor:
        return zeros_on_huge_pages(shape, dtype) if cpu else torch.zeros(shape, dtype=dtype, device=device)

    for layer in layers:
        shape = (num_blocks, block_size, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = zeros(shape), zeros(shape)
        layer.backend_name, layer.backend = name, backend
        caches.append((layer.k_cache, layer.v_cache))
    return caches


def attention_backend(model: nn.Module) -> str:
    """The backend `bind_kv_cache` resolved for `model` (what its attention metadata is built for)."""
    return next(m.backend_name for m in model.modules() if isinstance(m, Attention))
