"""The multi-LoRA op: `out[s:s+n] += scales[k] * ((x[s:s+n] @ a[k].T) @ b[k])` for every
segment (s = seg_start[g], n = seg_len[g], k = seg_slot[g]) of the step's batch.

a [S, R, in] holds each slot's A, b [S, R, out_features] each slot's B transposed: the expand
runs along the output features, which is what the CPU kernel vectorizes (no horizontal sums).

Segments are punica's scheme (SGMV): the caller orders the rows by adapter, so each adapter's
rows are consecutive and go through its A and B as one small GEMM pair (a shrink to the rank,
an expand back) instead of a gather of per-row weights; rows of no segment get nothing. The
segment tensors are int64 CPU tensors, built once per step (layers/lora.py, `LoRAMapping`) and
shared by every layer.

The intermediate `x a^T` ([n, R]) and the delta stay fp32 and are rounded once, when added to
`out`: in bf16, the rank-sized intermediate would lose bits that the expand then multiplies up.

On CPU (fp32 / bf16) this runs the kernel library's `lora_add_` (csrc/lora_cpu.cpp); elsewhere,
or where the library cannot be built, the same math in torch (`lora_add_torch`).
"""
from __future__ import annotations

import torch

from cluster.kernels import cpu_kernels


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., n] as [rows, n]; a view, since `out` is written in place."""
    return t.view(-1, t.shape[-1])


def lora_add_torch(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                   seg_start: torch.Tensor, seg_len: torch.Tensor, seg_slot: torch.Tensor,
                   scales: torch.Tensor) -> torch.Tensor:
    """The reference: one fp32 shrink and expand per segment, added to out (in place, one rounding).
    x [T, in], out [T, out_features], a [S, R, in], b [S, R, out_features] (B transposed),
    scales [S]; returns out."""
    out_rows, x_rows = _rows(out), x.reshape(-1, x.shape[-1])
    for start, n, slot in zip(seg_start.tolist(), seg_len.tolist(), seg_slot.tolist()):
        if n == 0:
            continue
        delta = (x_rows[start:start + n].float() @ a[slot].float().T) @ b[slot].float()
        rows = out_rows[start:start + n]
        rows.copy_(rows.float() + delta * scales[slot].float())
    return out


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, seg_start: torch.Tensor,
             seg_len: torch.Tensor, seg_slot: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """`lora_add_torch`'s semantics (same arguments; leading dims of x / out flattened), on the CPU
    kernel when every operand is a CPU tensor of one dtype it supports; returns out."""
    # Once per layer and step: checks a decode step can afford (is_cpu, not .device.type).
    if (x.dtype in cpu_kernels.DTYPES and out.dtype == a.dtype == b.dtype == x.dtype
            and out.is_cpu and x.is_cpu and a.is_cpu and b.is_cpu and scales.is_cpu):
        kernels = cpu_kernels.load()
        if kernels is not None:
            x_rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
            if x_rows.stride(-1) != 1:
                x_rows = x_rows.contiguous()
            kernels.lora_add_(out if out.dim() == 2 else _rows(out), x_rows, a, b, seg_start, seg_len,
                              seg_slot, scales)
            return out
    return lora_add_torch(out, x, a, b, seg_start, seg_len, seg_slot, scales)
