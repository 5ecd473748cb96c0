"""The CPU kernel library's multi-LoRA op (lora_add_, csrc/lora_cpu.cpp) against the torch
reference of layers/lora_ops.py, for every instruction set this CPU runs; the reference itself
against a per-row float64 formulation; and `lora_add`'s choice between the two."""
from __future__ import annotations

import pytest
import torch

from cluster.model.layers.lora_ops import lora_add, lora_add_torch


SLOTS, RANK = 4, 16
# (start, len, slot): decode rows (n = 1), short chunks (3, 16), a prefill chunk (38: the kernel's
# pieces of 32 + 6 rows, so register blocks of 4, 3, 2 and 1 rows all run), an empty segment;
# slot 3 is never used, rows 61-64 have no adapter (FREE), and slot 1 has rank 10 padded to RANK
# with zero rows.
SEGMENTS = [(0, 1, 2), (1, 3, 0), (4, 38, 1), (42, 0, 3), (42, 3, 0), (45, 16, 2), (65, 1, 1)]
TOKENS = 66
FREE = slice(61, 65)



def _segments(segments=SEGMENTS) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.tensor([s[i] for s in segments], dtype=torch.long) for i in range(3))


def _case(dtype, in_features: int, out_features: int, seed: int = 0):
    """x, out, a, b, scales with deltas of the order of out (so the add is not lost in rounding)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(TOKENS, in_features, generator=gen)
    out = torch.randn(TOKENS, out_features, generator=gen)
    a = torch.randn(SLOTS, RANK, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(SLOTS, RANK, out_features, generator=gen) / RANK ** 0.5  # B transposed
    a[1, 10:], b[1, 10:] = 0, 0  # rank 10 in a rank-16 slot
    scales = torch.rand(SLOTS, generator=gen) + 0.5
    return x.to(dtype), out.to(dtype), a.to(dtype), b.to(dtype), scales


def _per_row(out, x, a, b, segments, scales) -> torch.Tensor:
    """Row by row in float64, B (A x) in that order (b holds B^T): an independent formulation."""
    ref = out.double().clone()
    for start, n, slot in segments:
        for i in range(start, start + n):
            ref[i] += scales[slot].double() * (b[slot].double().T @ (a[slot].double() @ x[i].double()))
    return ref


def test_torch_reference_matches_per_row_float64():
    x, out, a, b, scales = _case(torch.float32, 96, 80)
    got = lora_add_torch(out.clone(), x, a, b, *_segments(), scales)
    torch.testing.assert_close(got.double(), _per_row(out, x, a, b, SEGMENTS, scales), atol=1e-5, rtol=1e-5)
    assert torch.equal(got[FREE], out[FREE])  # rows of no segment are untouched


def _assert_matches(got: torch.Tensor, ref: torch.Tensor, before: torch.Tensor) -> None:
    """fp32: within fp32 rounding of the sums; bf16: the same roundings but where the fp32 sums'
    order tips an element to the neighbouring bf16 value (one ulp, rarely)."""
    if got.dtype == torch.bfloat16:
        differ = (got != ref).float().mean().item()
        assert differ <= 1e-2, f"{differ:.2%} of the elements differ"
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=2 ** -7)
    else:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[FREE], before[FREE])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("in_features,out_features", [(576, 960), (100, 70)])  # vector widths / scalar tails
@pytest.mark.parametrize("strided_out", [False, True], ids=["contiguous", "strided_rows"])
def test_kernel_matches_torch(ops, dtype, in_features, out_features, strided_out):
    x, out, a, b, scales = _case(dtype, in_features, out_features, seed=in_features)
    ref = lora_add_torch(out.clone(), x, a, b, *_segments(), scales)
    # A row-strided out: the first columns of a wider tensor, as a fused projection's slice is.
    got = torch.cat([out, out[:, :5]], dim=1)[:, :out_features] if strided_out else out.clone()
    ops.lora_add_(got, x, a, b, *_segments(), scales)
    _assert_matches(got, ref, out)


def test_kernel_checks_dtypes_shapes_and_segments(ops):
    x, out, a, b, scales = _case(torch.float32, 32, 24)
    segs = _segments()
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.lora_add_(out.bfloat16(), x, a, b, *segs, scales)
    with pytest.raises(RuntimeError, match="share one dtype"):
        ops.lora_add_(out, x, a, b.bfloat16(), *segs, scales)
    with pytest.raises(RuntimeError, match="float32 and bfloat16"):
        ops.lora_add_(out.half(), x.half(), a.half(), b.half(), *segs, scales)
    with pytest.raises(RuntimeError, match="scales"):
        ops.lora_add_(out, x, a, b, *segs, scales.double())
    with pytest.raises(RuntimeError, match="shapes do not match"):
        ops.lora_add_(out, x[:, :31], a, b, *segs, scales)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lora_add_(out, x, a, b, *_segments([(TOKENS - 2, 3, 0)]), scales)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.lora_add_(out, x, a, b, *_segments([(0, 1, SLOTS)]), scales)


def test_lora_add_uses_the_kernel_on_cpu_and_torch_otherwise():
    """Leading dims are flattened; fp16 (no kernel) takes the torch reference."""
    x, out, a, b, scales = _case(torch.float32, 64, 48)
    ref = lora_add_torch(out.clone(), x, a, b, *_segments(), scales)
    got = out.clone().view(2, TOKENS // 2, 48)
    assert lora_add(got, x.view(2, TOKENS // 2, 64), a, b, *_segments(), scales) is got
    torch.testing.assert_close(got.view(TOKENS, 48), ref, atol=1e-5, rtol=1e-5)
    half = [t.half() for t in (out, x, a, b)]
    got = lora_add(half[0].clone(), *half[1:], *_segments(), scales)
    torch.testing.assert_close(got, lora_add_torch(half[0].clone(), *half[1:], *_segments(), scales))
