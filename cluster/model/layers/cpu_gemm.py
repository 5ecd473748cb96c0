"""bf16 linear layers on CPU through oneDNN with the weight reordered once, after loading.

`F.linear` hands oneDNN the weight in its checkpoint layout on every call. Reordering it once
into oneDNN's blocked layout (what its AMX / AVX-512-BF16 kernels read) made SmolLM2's decode
GEMMs 1.5-2.5x faster on this project's Xeon at batch 1-128, and prefill-sized ones no slower,
with bit-identical results (`tests/test_cpu_gemm.py` asserts equality). fp32 gains nothing
there (MKL's sgemm is as fast), so only bf16 weights on a CPU oneDNN runs bf16 on are packed.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] bf16 -> an opaque oneDNN tensor for `packed_linear` (no batch-size hint: one
    layout serves every batch size)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for the weight `packed` was made from; x is [..., in]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Pack every layer with a `pack_weight(release)` method whose weight `can_pack`; returns
    how many. A weight another module also uses (a head tied to the embedding) keeps its
    plain copy; the others are released, so packing costs no memory."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    packed = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "pack_weight") and weight is not None and can_pack(weight):
            module.pack_weight(release=uses[id(weight)] == 1)
            packed += 1
    return packed
