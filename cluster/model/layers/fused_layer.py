"""Decode steps of a few rows run each decoder layer as one call into the CPU kernel library
(csrc/decoder_layer_cpu.cpp) instead of the modular layer's ~10 Python-level calls.

At batch 1 the layer's four GEMMs stream its weights at memory speed; what a SmolLM2 step spent
besides was Python: module calls, views, op dispatch. One call a layer took a step from 11.3 to
8.5 ms on 2 cores (~95 us a layer; the modular layers alternated with it in one process). The kernel's
`decoder_layer` runs the same ops in the same order (norms, skinny GEMMs, rotary + cache write +
paged attention, SiLU-and-mul), so its result is the modular layer's, bit for bit; the modular
path stays for everything else and is the reference the tests compare against.

A model's stack of layers gets a `FusedDecode` at load on CPU (`attach`) when every layer can
take it: Llama-shaped (Llama, Qwen2, Qwen3's per-head q/k norms), one rank, every projection with
a skinny form (bf16 packed, or quantized). A step then takes it when `takes` says so: no more rows
than every projection's `skinny_rows` (3 dense, 12 int8 / Q8_0, 64 Q4 with int8 activations), the
CPU attention kernel takes every query (no SDPA prefill chunk), no LoRA adapters attached.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from cluster.kernels.cpu_kernels import TILE_QUERIES
from cluster.model.context import get_forward_context
from cluster.model.layers.attention import Attention


@dataclass(frozen=True)
class _Layer:
    attn: Attention  # its k_cache / v_cache are bound after load
    weights: tuple  # decoder_layer's arguments from input_norm to down_n (q_norm / k_norm None: none)


def _projection(linear: nn.Module) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, int] | None:
    packed = linear.packed
    if packed is None or packed.skinny_rows == 0:
        return None
    return packed.skinny_tensors, linear.bias, packed.out_features


def _layer(layer: nn.Module) -> tuple[_Layer, int] | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.parallel.world_size != 1 for lin in linears):
        return None
    projections = [_projection(lin) for lin in linears]
    if any(p is None for p in projections):
        return None
    norms = layer.input_layernorm, layer.post_attention_layernorm
    qk = (attn.q_norm, attn.k_norm) if attn.qk_norm else None
    if norms[0].eps != norms[1].eps or (qk is not None and qk[0].eps != qk[1].eps):
        return None
    qk_args = (qk[0].weight, qk[1].weight, qk[0].eps) if qk is not None else (None, None, 0.0)
    weights = (norms[0].weight, norms[1].weight, norms[0].eps, *qk_args, *(x for p in projections for x in p))
    return _Layer(attn.attn, weights), min(lin.packed.skinny_rows for lin in linears)


@dataclass(frozen=True)
class FusedDecode:
    """One `decoder_layer` call per layer of a model's stack."""

    layers: tuple[_Layer, ...]
    max_rows: int
    kernels: Any  # CpuKernels
    lora_probe: nn.Module  # a projection: its `lora` is set once adapters are enabled

    @classmethod
    def of(cls, layers: nn.ModuleList, kernels: Any) -> "FusedDecode | None":
        """The fused form of `layers` (Llama-shaped decoder layers), or None if one cannot take it."""
        fused = [_layer(layer) for layer in layers]
        if kernels is None or not fused or any(f is None for f in fused):
            return None
        return cls(tuple(f[0] for f in fused), min(f[1] for f in fused), kernels, layers[0].self_attn.qkv_proj)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether this step (hidden [T, hidden_size]) can run fused."""
        if hidden.shape[0] > self.max_rows or self.lora_probe.lora is not None:
            return False
        return self.layers[0].attn.kernel_takes(get_forward_context())

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the embeddings `hidden`: (last layer's output, residual stream)."""
        meta = get_forward_context()
        km = meta.kernel
        residual = None
        for layer in self.layers:
            a = layer.attn
            hidden, residual = self.kernels.decoder_layer(
                hidden, residual, *layer.weights, *rope, a.k_cache, a.v_cache, meta.slot_mapping, km.block_table,
                km.seq_lens, km.query_start, km.query_len, a.scale, TILE_QUERIES)
        return hidden, residual


def attach(model: nn.Module, kernels: Any) -> int:
    """Give each decoder stack of `model` (a module with a `fused_decode` slot and `layers`) its
    FusedDecode where it can take one; returns how many did."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_decode"):
            module.fused_decode = FusedDecode.of(module.layers, kernels)
            count += module.fused_decode is not None
    return count
