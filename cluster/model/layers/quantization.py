"""Quantized weights on CPU: `quantization="int8"` for any checkpoint, and a GGUF's Q8_0, Q4_0
and Q4_1 tensors served in their own blocks (`quantization="gguf"`; without it a GGUF is
dequantized at load). On a CPU with AVX512-VNNI, int8 and Q8_0 run W8A8 from 3 rows a step
(activations quantized on the fly per row and group of 64 inputs for int8, per the weight's runs
of 32 for Q8_0, cluster/kernels/csrc/int8_gemm_cpu.cpp) and Q4_0 / Q4_1 run W4A8 up to
Q4_INT8_MAX_ROWS rows (per run of 32, as llama.cpp's Q4 dot products quantize them,
cluster/kernels/csrc/skinny_gemm_cpu.cpp); everything else is weight-only (activations stay in
the model's dtype).

Formats (the kernel library's, cluster/kernels/csrc/skinny_gemm_cpu.cpp):
- "int8": q int8 and one fp32 scale per output feature (absmax / 127), quantized at load.
- "q8_0": q int8 and one scale per run of 32 inputs (GGUF Q8_0).
- "q4_1" / "q4_0": q in [0, 15] two to a byte, w = q d + m with fp16 d and m per run of 32
  (GGUF Q4_1; Q4_0 is the same with m = -8 d).

A GGUF's blocks are re-derived from the dequantized values the loader reads (transformers gives
them in HF's layout, q/k rows un-permuted, merged and sharded like any checkpoint): llama.cpp's
quantizers always leave a block's extreme value on the end of the integer range (127 d for
Q8_0; q = 0 and 15 for Q4_1; q = 0 for Q4_0), so d and m come back exactly and every q is an
integer. Each tensor is checked to dequantize back to the same values bit for bit; one that
does not stays in floats, with a warning naming it.

- A few rows (decode): the quantized weight is read once and widened in registers, so a batch-1
  step reads ~1.1 (int8) or ~0.6 (4-bit) bytes a weight instead of bf16's 2.
- More rows (prefill, large batches): int8 and Q8_0 with W8A8 multiply int8 by int8 (VNNI) on
  the same blocks (int8 ~1.4x bf16's GEMM; SmolLM2's 120 Q8_0 layer GEMMs at 64 rows 45 ms
  against 131 dequantizing); otherwise the layer's weight is dequantized into a scratch buffer
  reused by every layer, then one GEMM (one pass over the weight on top of bf16's work).

Resident weights are the quantized ones; there is no float copy. The token embedding stays in
the model's dtype (a lookup reads one row per token: quantizing it saves memory, not time). The
LM head is quantized too, as llama.cpp's output tensor is: at batch 1 it is a fifth of SmolLM2's
bytes per step. A tied head leaves the embedding as it is and quantizes a copy.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("int8", "gguf")
GGUF_GROUP = 32  # inputs per block of the GGUF types served quantized
GGUF_SERVED = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1"}  # GGUF type -> our format
# The GGUF tensors behind the linear layers (llama.cpp's names, blk.N.<part>.weight).
_GGUF_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# Rows of x up to which QuantizedWeight.linear dequantizes in registers instead of through a
# scratch weight and a GEMM: on SmolLM2's 120 layer GEMMs (this EPYC, 2 threads) int8 took 3.9 ms
# at 1 row, 8.8 at 4, 16.6 at 8, where the dequantize-and-GEMM path costs ~27 ms at 8 to 16 rows.
SKINNY_MAX_ROWS = 12
# The same for Q4 weights times int8 activations (q4_linear with q4_int8_activations): its
# integer dot products keep it ahead of dequantize-and-GEMM far longer.
Q4_INT8_MAX_ROWS = 64

_scratch = threading.local()  # per thread: TP ranks in one process (tests) each get their own


def _scratch_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A [n, k] buffer of `dtype`, reused by every layer of this thread (one grows to the largest)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n * k:
        buf = buffers[dtype] = torch.empty(n * k, dtype=dtype)
    return buf[: n * k].view(n, k)


def w8a8_available(kernels: Any) -> bool:
    """Whether int8 and Q8_0 weights run W8A8 here (the kernel library's int8_gemm needs AVX512-VNNI);
    without it, says once that many-row steps dequantize into a float GEMM instead."""
    if not kernels.has_int8_gemm:
        _warn_no_w8a8(kernels.isa)
    return kernels.has_int8_gemm


@functools.cache
def _warn_no_w8a8(isa: str) -> None:
    logger.warning("int8 / Q8_0 weights: this CPU (or the %s kernel build) has no AVX512-VNNI, so steps of more than "
                   "%d rows dequantize the weights into a float GEMM instead of int8 dot products", isa, SKINNY_MAX_ROWS)


def quantize_int8(weight: torch.Tensor, group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (q int8 [N, K], scales float32 [N, K // group_size]): symmetric, scale =
    absmax / 127 per output feature (group_size None) or per run of group_size inputs, q =
    round(w / scale) in [-127, 127]. An all-zero row or group gets scale 1 (its q is 0)."""
    n, k = weight.shape
    group = group_size or k
    if k % group:
        raise ValueError(f"group_size {group} does not divide the weight's {k} inputs")
    w = weight.detach().float().view(n, k // group, group)
    scales = w.abs().amax(dim=-1) / 127.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return q.view(n, k), scales


def q4_blocks(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 / Q4_0 tensor's blocks from its dequantized values [N, K] (fp32): (q uint8 [N, K]
    in [0, 15], d, m float16 [N, K / 32]) with w = q d + m. Q4_1: m is the block's minimum
    (q = 0), d its range / 15. Q4_0: the value of largest magnitude is -8 d (q = 0), m = -8 d."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GGUF_GROUP, GGUF_GROUP)
    if kind == "q4_1":
        m = w.amin(dim=-1)
        d = ((w.amax(dim=-1) - m) / 15).half().float()
    else:
        extreme = w.gather(-1, w.abs().argmax(dim=-1, keepdim=True)).squeeze(-1)
        d = extreme / -8  # exact: a power of two
        m = -8 * d
    safe = torch.where(d != 0, d, torch.ones_like(d))
    q = torch.round((w - m.unsqueeze(-1)) / safe.unsqueeze(-1)).clamp_(0, 15)
    q = torch.where(d.unsqueeze(-1) != 0, q, torch.zeros_like(q))
    return q.to(torch.uint8).view(n, k), d.half(), m.half()


@dataclass(frozen=True)
class QuantizedWeight:
    """A quantized weight in the kernel library's blocked layout: the same interface as
    cpu_gemm.PackedWeight. `linear(x, bias)` equals `F.linear(x, dequantized, bias)` up to the
    order of the fp32 sums and x's rounding; x float32 or bf16, out in x's dtype."""

    kind: str  # "int8" | "q8_0" | "q4_0" | "q4_1"
    tensors: tuple[torch.Tensor, ...]  # int8 / q8_0: (q, scales); 4-bit: (q, d, m)
    out_features: int
    in_features: int
    kernels: Any  # CpuKernels
    offsets: torch.Tensor | None = None  # int8 / q8_0 run W8A8: kernels.int8_gemm_offsets of its blocks

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, kernels: Any) -> "QuantizedWeight":
        """`weight` [N, K] float in format `kind`: "int8" quantizes it; the GGUF formats take it
        as the dequantized values of such blocks (see the module docstring)."""
        n, k = weight.shape
        offsets = None
        if kind in ("int8", "q8_0"):
            packed = kernels.int8_pack(*quantize_int8(weight, GGUF_GROUP if kind == "q8_0" else None))
            if w8a8_available(kernels):
                offsets = kernels.int8_gemm_offsets(*packed)
        elif kind in ("q4_0", "q4_1"):
            packed = kernels.q4_pack(*q4_blocks(weight, kind))
        else:
            raise ValueError(f"unknown quantized format {kind!r}")
        return cls(kind, tuple(packed), n, k, kernels, offsets)

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=dtype) if out is None else out
        if len(self.tensors) == 2:
            return self.kernels.int8_dequant_(out, *self.tensors)
        return self.kernels.q4_dequant_(out, *self.tensors)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.offsets is not None:  # W8A8 from 3 rows, int8_linear below them (the kernel library's choice)
            return self.kernels.packed_linear(x, self.skinny_tensors, bias, self.out_features)
        if x.numel() <= self.skinny_rows * self.in_features:
            op = self.kernels.int8_linear if len(self.tensors) == 2 else self.kernels.q4_linear
            return op(x, *self.tensors, bias, self.out_features)
        weight = self.dequantize(x.dtype, _scratch_weight(self.out_features, self.in_features, x.dtype))
        return F.linear(x, weight, bias)

    @property
    def skinny_rows(self) -> int:
        """Rows up to which `linear` runs the kernel library's GEMM on the blocks."""
        if self.kind in ("q4_0", "q4_1") and self.kernels.q4_int8_activations:
            return Q4_INT8_MAX_ROWS
        return SKINNY_MAX_ROWS

    @property
    def skinny_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight as the kernel library's `packed_linear` reads it."""
        return self.tensors if self.offsets is None else (*self.tensors, self.offsets)

    def with_skinny_tensors(self, tensors: tuple[torch.Tensor, ...]) -> "QuantizedWeight":
        """The same weight with its blocks in `tensors` (copies of `skinny_tensors`)."""
        if self.offsets is None:
            return replace(self, tensors=tensors)
        return replace(self, tensors=tensors[:2], offsets=tensors[2])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.skinny_tensors)


@dataclass(frozen=True)
class QuantPlan:
    """Which weights a model serves quantized, and in which format (None: floats), learned once
    from the options and the checkpoint (ModelConfig.quant_plan)."""

    layers: str | None  # the decoder's linear layers
    head: str | None  # the LM head


def quant_plan(quantization: str | None, path: str, device: str) -> QuantPlan | None:
    """The plan for `quantization` (None, "int8", "gguf") and the model at `path`. "gguf" serves
    the layers and head whose GGUF type is in GGUF_SERVED in their blocks and dequantizes the
    rest to the model's dtype (said once in the log). Without it a GGUF loads dequantized, as
    any checkpoint loads in its dtype: in-register dequantization wins at a few rows a step and
    loses from about a dozen (docs/quantization.md), so it is the operator's choice. Quantization
    runs on CPU only (its kernels are CPU kernels). Raises ValueError naming the option."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS} or null, got {quantization!r}")
    if quantization is None:
        return None
    if quantization == "gguf" and not path.endswith(".gguf"):
        raise ValueError(f"quantization='gguf' needs a .gguf model file, got {path!r}")
    if device != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPU only (its kernels are CPU kernels); "
                         f"the device is {device!r}")
    if quantization == "int8":
        return QuantPlan(layers="int8", head="int8")
    layer_types, head_type = gguf_weight_types(path)
    layers = GGUF_SERVED.get(next(iter(layer_types))) if len(layer_types) == 1 else None
    if layers is None:
        logger.info("%s: layer weights of type %s are served dequantized (GGUF types served in their blocks: %s)",
                    Path(path).name, "/".join(sorted(layer_types)), ", ".join(GGUF_SERVED))
    plan = QuantPlan(layers=layers, head=GGUF_SERVED.get(head_type or ""))
    return plan if plan.layers or plan.head else None


def gguf_weight_types(path: str) -> tuple[set[str], str | None]:
    """(the types of a GGUF's layer weights, the type of its LM head: output.weight, else the
    tied token_embd.weight)."""
    from gguf import GGUFReader

    tensors = {t.name: t.tensor_type.name for t in GGUFReader(path).tensors}
    layers = {kind for name, kind in tensors.items()
              if name.startswith("blk.") and name.split(".")[-2] in _GGUF_LINEARS}
    return layers, tensors.get("output.weight", tensors.get("token_embd.weight"))


def quantize_module(name: str, module: Any, plan: QuantPlan | None, kernels: Any) -> QuantizedWeight | None:
    """`module`'s weight (fp32) as the plan serves it, or None to leave it to the float GEMMs. A
    GGUF tensor must come back bit for bit (see the module docstring), and its inputs must be
    whole blocks (a TP shard may cut one); otherwise it stays in floats, with a warning."""
    kind = None if plan is None else (plan.head if getattr(module, "is_lm_head", False) else plan.layers)
    if kind is None or kernels is None:
        return None
    weight = module.weight.detach()
    if kind != "int8" and weight.shape[1] % GGUF_GROUP:
        logger.warning("%s: its %d inputs are not whole %d-wide GGUF blocks (a TP shard?); served dequantized",
                       name, weight.shape[1], GGUF_GROUP)
        return None
    quantized = QuantizedWeight.quantize(weight, kind, kernels)
    if kind != "int8" and not torch.equal(quantized.dequantize(torch.float32), weight.float()):
        logger.warning("%s: the weights are not %s blocks as llama.cpp rounds them; served dequantized",
                       name, kind.upper())
        return None
    return quantized
