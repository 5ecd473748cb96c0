"""Decode steps of a few rows run a model's decoder layers as one call into the CPU kernel library
(csrc/decoder_layer_cpu.cpp) instead of the modular layers' ~10 Python-level calls each.

At batch 1 the layer's four GEMMs stream its weights at memory speed; what a SmolLM2 step spent
besides was Python: module calls, views, op dispatch. One call a layer took a step from 11.3 to
8.5 ms on 2 cores (~95 us a layer; the modular layers alternated with it in one process); one call
for the stack then took the other calls' argument conversion and dispatch off. The kernel's
`decoder_layers` runs the same ops in the same order (norms, skinny GEMMs, rotary + cache write +
paged attention, SiLU-and-mul), so its result is the modular layers', bit for bit; the modular
path stays for everything else and is the reference the tests compare against.

A model's stack of layers gets a `FusedDecode` at load on CPU (`attach`) when every layer can
take it: Llama-shaped (Llama, Qwen2, Qwen3's per-head q/k norms), one rank, every projection with
a skinny form (bf16 or fp32 packed, or quantized; a StackedWeight of GGUF tensors of several types too). A
step then takes it when `takes` says so: no more rows than every projection's `skinny_rows` (3
bf16 beside a fast bf16 GEMM, every row count where there is none, 8 fp32 (64 with AVX2), 12 int8 / Q8_0, 64 Q4
with int8 activations and k-quants), the
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


def _projection(linear: nn.Module) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None, int] | None:
    packed = linear.packed
    if packed is None or packed.skinny_rows == 0:
        return None
    return packed.skinny_tensors, linear.bias, packed.out_features


@dataclass(frozen=True)
class _Layer:
    attn: Attention
    norms: tuple[nn.Module, nn.Module]  # input, post-attention RMSNorm
    qk_norms: tuple[nn.Module, nn.Module] | None  # Qwen3's per-head q / k norms
    projections: tuple  # (tensors, bias, out_features) of qkv, o, gate_up, down
    max_rows: int


def _layer(layer: nn.Module) -> _Layer | None:
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.parallel.world_size != 1 for lin in linears):
        return None
    projections = tuple(_projection(lin) for lin in linears)
    if any(p is None for p in projections):
        return None
    return _Layer(attn.attn, (layer.input_layernorm, layer.post_attention_layernorm),
                  (attn.q_norm, attn.k_norm) if attn.qk_norm else None, projections,
                  min(lin.packed.skinny_rows for lin in linears))


@dataclass(frozen=True)
class FusedDecode:
    """Every layer of a model's stack in one `decoder_layers` call; its arguments besides the
    step's are gathered once, here."""

    attns: tuple[Attention, ...]  # each layer's; their k_cache / v_cache are bound after load
    weights: tuple  # decoder_layers' arguments from norms to out_features
    max_rows: int
    kernels: Any  # CpuKernels
    lora_probe: nn.Module  # a projection: its `lora` is set once adapters are enabled

    @classmethod
    def of(cls, layers: nn.ModuleList, kernels: Any) -> "FusedDecode | None":
        """The fused form of `layers` (Llama-shaped decoder layers), or None if one cannot take it.
        The kernel takes one norm eps, one q/k-norm eps and one attention scale for the stack."""
        fused = [_layer(layer) for layer in layers]
        if kernels is None or not fused or any(f is None for f in fused):
            return None
        eps = {n.eps for f in fused for n in f.norms}
        qk_eps = {n.eps for f in fused for n in f.qk_norms or ()}
        if len(eps) != 1 or len(qk_eps) > 1 or len({f.attn.scale for f in fused}) != 1 \
                or len({f.qk_norms is None for f in fused}) != 1:
            return None
        projections = [p for f in fused for p in f.projections]
        weights = ([n.weight for f in fused for n in f.norms], [n.weight for f in fused for n in f.qk_norms or ()],
                   eps.pop(), qk_eps.pop() if qk_eps else 0.0, [t for p in projections for t in p[0]],
                   [len(p[0]) for p in projections], [p[1] for p in projections], [p[2] for p in projections])
        return cls(tuple(f.attn for f in fused), weights, min(f.max_rows for f in fused),
                   kernels, layers[0].self_attn.qkv_proj)

    def takes(self, hidden: torch.Tensor) -> bool:
        """Whether this step (hidden [T, hidden_size]) can run fused."""
        if hidden.shape[0] > self.max_rows or self.lora_probe.lora is not None:
            return False
        return self.attns[0].kernel_takes(get_forward_context())

    def __call__(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer on the embeddings `hidden`: (last layer's output, residual stream)."""
        meta = get_forward_context()
        km = meta.kernel
        return self.kernels.decoder_layers(
            hidden, *self.weights, *rope, [a.k_cache for a in self.attns], [a.v_cache for a in self.attns],
            meta.slot_mapping, km.block_table, km.seq_lens, km.query_start, km.query_len, self.attns[0].scale,
            TILE_QUERIES)


def attach(model: nn.Module, kernels: Any) -> int:
    """Give each decoder stack of `model` (a module with a `fused_decode` slot and `layers`) its
    FusedDecode where it can take one; returns how many did."""
    count = 0
    for module in model.modules():
        if hasattr(module, "fused_decode"):
            module.fused_decode = FusedDecode.of(module.layers, kernels)
            count += module.fused_decode is not None
    return count
