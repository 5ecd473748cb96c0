"""bf16 linear layers on CPU with the weight reordered once, after loading, into the layouts
the CPU GEMMs read.

`F.linear` hands oneDNN the weight in its checkpoint layout on every call. Reordering it once
into oneDNN's blocked layout (what its AMX / AVX-512-BF16 kernels read) made SmolLM2's decode
GEMMs 1.5-2.5x faster on this project's Xeon at batch 1-128, and prefill-sized ones no slower,
with bit-identical results (`tests/test_cpu_layer_ops.py` asserts equality). fp32 gains nothing
there (MKL's sgemm is as fast), so only bf16 weights on a CPU oneDNN runs bf16 on are packed.

For a few rows (decode at batch 1-3) the kernel library's `skinny_linear` reads a second copy of
the weight in its own layout at memory speed, where oneDNN streamed it at ~60% of that
(csrc/skinny_gemm_cpu.cpp). The copy costs the weight's size again: what single-stream decode
speed is bought with. Its sums run in another order than oneDNN's, so in bf16 a row's result can
differ in the last bit between the two: a request's greedy tokens can depend on how many rows
its steps had (as they already did on the attention path a prefix-cache hit takes), as with
vLLM's kernels. fp32 weights are never packed.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from cluster.model.huge_pages import Arena

# Rows of x up to which `PackedWeight.linear` runs skinny_linear instead of oneDNN: it streams the
# weights at ~32 GB/s at 1-2 rows and ~27 at 3 on this EPYC, oneDNN at ~20; from 4 rows its fp32
# FMAs fall behind oneDNN's bf16 dot products (SmolLM2's 120 layer GEMMs, two threads).
SKINNY_MAX_ROWS = 3


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] bf16 weight in oneDNN's blocked layout (any batch; no batch-size hint, one
    layout serves them all) and, when the kernel library is loaded, its skinny layout too.
    `linear` equals `F.linear(x, weight, bias)`: bit-identical on the oneDNN path, the same
    products summed in another order (fp32, one rounding) on the skinny path."""

    onednn: torch.Tensor
    out_features: int
    in_features: int
    skinny: torch.Tensor | None = None
    kernels: Any = None  # CpuKernels, with skinny

    @classmethod
    def of(cls, weight: torch.Tensor, kernels: Any = None) -> "PackedWeight":
        weight = weight.detach().contiguous()
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        skinny = kernels.skinny_pack(weight) if kernels is not None else None
        return cls(onednn, weight.shape[0], weight.shape[1], skinny, kernels)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.skinny is not None and x.numel() <= SKINNY_MAX_ROWS * self.in_features:
            return self.kernels.skinny_linear(x, self.skinny, bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")

    @property
    def skinny_rows(self) -> int:
        """Rows up to which `linear` runs the skinny GEMM (0: never)."""
        return 0 if self.skinny is None else SKINNY_MAX_ROWS

    @property
    def skinny_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight as the kernel library's `packed_linear` reads it."""
        return (self.skinny,)

    def with_skinny_tensors(self, tensors: tuple[torch.Tensor, ...]) -> "PackedWeight":
        """The same weight with its skinny form in `tensors` (copies of `skinny_tensors`)."""
        return replace(self, skinny=tensors[0])

    @property
    def nbytes(self) -> int:
        """Bytes resident: oneDNN's copy (its logical size) and the skinny one."""
        skinny = 0 if self.skinny is None else self.skinny.numel() * self.skinny.element_size()
        return self.onednn.numel() * self.onednn.element_size() + skinny


def pack_linears(model: nn.Module, kernels: Any = None, plan: Any = None) -> int:
    """Give every layer with a `pack_weight(packed, release)` method (linears, the LM head) its
    weight in the CPU GEMMs' layouts: where the quantization.QuantPlan `plan` says so (and with
    `kernels`) a QuantizedWeight, else, where the weight `can_pack`, a PackedWeight (with
    `kernels`, its skinny layout too). Returns how many. A weight another module also uses (a
    head tied to the embedding) keeps its plain copy; the others are released."""
    from cluster.model.layers.quantization import quantize_module

    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if (not hasattr(module, "pack_weight") or weight is None or weight.device.type != "cpu"
                or module.packed is not None):  # a tied head quantized already keeps the embedding's
            continue
        quantized = quantize_module(name, module, plan, kernels)
        if quantized is not None:
            module.pack_weight(quantized, release=uses[id(weight)] == 1)
        elif can_pack(weight):
            module.pack_weight(PackedWeight.of(weight, kernels), release=uses[id(weight)] == 1)
        else:
            continue
        packed += 1
    return packed


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the form every packed weight's decode GEMM streams (`skinny_tensors`: a PackedWeight's
    skinny layout, a QuantizedWeight's blocks) into one arena on huge pages (cluster/model/
    huge_pages.py), in module order; returns the bytes moved. Each module drops its old copy as
    it gets the new one, so the peak is the arena and one weight. oneDNN's copy is opaque to torch
    and stays where it is."""
    modules = [m for m in model.modules() if getattr(m, "packed", None) is not None and m.packed.skinny_rows]
    arena = Arena(Arena.size_of([t for m in modules for t in m.packed.skinny_tensors]))
    for m in modules:
        m.pack_weight(m.packed.with_skinny_tensors(tuple(arena.copy(t) for t in m.packed.skinny_tensors)), False)
    return arena.used
