"""Quantized weights on CPU: `quantization="int8"` for any checkpoint, and a GGUF's Q8_0, Q4_0, Q4_1,
Q4_K, Q5_K and Q6_K tensors served in their own blocks (`quantization="gguf"`; without it a GGUF is
dequantized at load). On a CPU with AVX512-VNNI, int8 and Q8_0 run W8A8 from 3 rows a step
(activations quantized on the fly per row and group of 64 inputs for int8, per the weight's runs of
32 for Q8_0, cluster/kernels/csrc/int8_gemm_cpu.cpp); the AVX2 build runs them W8A8 at any number
of rows (per row and run of 32, cluster/kernels/csrc/skinny_gemm_cpu.cpp). Q4_0 / Q4_1 run W4A8
(per run of 32, as llama.cpp's Q4 dot products quantize them; cluster/kernels/csrc/skinny_gemm_cpu.cpp)
up to INT8_X_MAX_ROWS rows on the VNNI build and at any number of rows on the AVX2 build; the
k-quants always multiply int8 activations (per row and super-block of 256, as llama.cpp's Q8_K;
cluster/kernels/csrc/kquant_gemm_cpu.cpp, VNNI, AVX2 or plain loops); everything else is
weight-only (activations stay in the model's dtype).

Formats (the kernel library's):
- "int8": q int8 and one fp32 scale per output feature (absmax / 127), quantized at load.
- "q8_0": q int8 and one scale per run of 32 inputs (GGUF Q8_0).
- "q4_1" / "q4_0": q in [0, 15] two to a byte, w = q d + m with fp16 d and m per run of 32
  (GGUF Q4_1; Q4_0 is the same with m = -8 d).
- "q4_k" / "q5_k" / "q6_k": GGUF's super-blocks of 256 inputs (6-bit scales and mins, or Q6_K's
  int8 scales, per run of 32 / 16), bit for bit as in the file, four features' side by side.

A GGUF served with "gguf" is read tensor by tensor (cluster/model/gguf_file.py): the tensors of a
served type reach the layers as their raw blocks (`GGUFBlocks`), which keep this rank's rows (or
whole blocks of inputs) and are packed here after loading (`quantize_module`); nothing is
dequantized to fp32 and re-derived. The plan (quant_plan.py) decides per tensor: a linear layer's
or the head's tensor of a type in GGUF_SERVED is served in its blocks, any other dequantized. A
merged projection whose tensors differ in type (Q4_K_M's Q6_K attn_v beside Q4_K q and k) is a
`StackedWeight` of one quantized weight per type.

Other checkpoints with a GGUF format in the plan (tests build such plans over HF folders) have
their blocks re-derived from the float values: llama.cpp's quantizers always leave a block's
extreme value on the end of the integer range (127 d for Q8_0; q = 0 and 15 for Q4_1; q = 0 for
Q4_0), so d and m come back exactly and every q is an integer. Each tensor is checked to
dequantize back to the same values bit for bit; one that does not stays in floats, with a warning.

- A few rows (decode): the quantized weight is read once and widened in registers, so a batch-1
  step reads ~1.1 (int8) or ~0.6 (4-bit) bytes a weight instead of bf16's 2.
- More rows (prefill, large batches): int8 and Q8_0 with W8A8 (VNNI), and int8, Q8_0 and Q4 on
  the AVX2 build, multiply int8 activations on the same blocks (int8 ~1.4x bf16's GEMM; SmolLM2's
  120 Q8_0 layer GEMMs at 64 rows 45 ms against 131 dequantizing), as do the k-quants, in tiles
  of INT8_X_ROW_TILE rows; otherwise the layer's weight is dequantized into a scratch buffer
  reused by every layer, then one GEMM (one pass over the weight on top of bf16's work).

Resident weights are the quantized ones; there is no float copy. The token embedding stays in
the model's dtype (a lookup reads one row per token: quantizing it saves memory, not time), except
a GGUF's in k-quant blocks, whose rows are read from the blocks (its own, or a tied head's:
embedding.read_rows_from_blocks). The LM head is quantized too, as llama.cpp's output tensor is:
at batch 1 it is a fifth of SmolLM2's bytes per step. A tied head in another format quantizes a
copy and leaves the embedding as it is.
"""
from __future__ import annotations

import functools
import logging
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from cluster.model.layers.quant_plan import QuantPlan

logger = logging.getLogger(__name__)

GGUF_GROUP = 32  # inputs per block of Q8_0 / Q4_0 / Q4_1 (and of the formats re-derived from floats)
KQUANT_BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}  # a super-block of 256 inputs
GGUF_SERVED = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1",  # GGUF type -> our format
               "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k",
               "Q5_0": "q8_0"}  # rewritten as Q8_0 blocks of the same values (gguf_file.q5_0_as_q8_0)
# GGUF types whose blocks give single rows (QuantizedWeight.rows): an embedding of these is looked
# up in its blocks (embedding.read_rows_from_blocks).
ROW_READ_TYPES = frozenset(t for t, fmt in GGUF_SERVED.items() if fmt in KQUANT_BLOCK_BYTES)
# The GGUF tensors behind the linear layers (llama.cpp's names, blk.N.<part>.weight).

# Rows up to which a step with k-quant layers runs them in the one-call decoder layers (their
# kernel itself takes any number of rows: QuantizedWeight.linear always runs it).
KQUANT_FUSED_MAX_ROWS = 64
# Rows of x up to which QuantizedWeight.linear dequantizes in registers instead of through a
# scratch weight and a GEMM: on SmolLM2's 120 layer GEMMs (this EPYC, 2 threads) int8 took 3.9 ms
# at 1 row, 8.8 at 4, 16.6 at 8, where the dequantize-and-GEMM path costs ~27 ms at 8 to 16 rows.
SKINNY_MAX_ROWS = 12
# The same for weights times int8 activations (q4_linear with q4_int8_activations, int8_linear
# with int8_int8_activations): their integer dot products keep them ahead of dequantize-and-GEMM
# far longer.
INT8_X_MAX_ROWS = 64
# Rows of x one call of an int8-activation kernel takes where `linear` runs it at any number of
# rows (k-quants; int8, Q8_0 and Q4 on the AVX2 build): x's int8 copy, rows x K bytes, then stays
# in cache while the weight streams past it; a 2,048-token prefill's in one call was read from
# memory again for every strip of the weight, and lost to dequantize-and-GEMM
# (docs/quantization.md, "The kernels").
INT8_X_ROW_TILE = 256

_scratch = threading.local()  # per thread: TP ranks in one process (tests) each get their own


def _scratch_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """A [n, k] buffer of `dtype`, reused by every layer of this thread (one grows to the largest)."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    buf = buffers.get(dtype)
    if buf is None or buf.numel() < n * k:
        buf = buffers[dtype] = torch.empty(n * k, dtype=dtype)
    return buf[: n * k].view(n, k)


def w8a8_available(kernels: Any) -> bool:
    """Whether int8 and Q8_0 weights run the kernel library's int8_gemm here (AVX512-VNNI); where
    neither it nor the AVX2 build's W8A8 int8_linear runs, says once that steps of many rows
    dequantize into a float GEMM instead."""
    if not kernels.has_int8_gemm and not kernels.int8_int8_activations:
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

    kind: str  # "int8" | "q8_0" | "q4_0" | "q4_1" | "q4_k" | "q5_k" | "q6_k"
    tensors: tuple[torch.Tensor, ...]  # int8 / q8_0: (q, scales); 4-bit: (q, d, m); k-quants: (blocks,)
    out_features: int
    in_features: int
    kernels: Any  # CpuKernels
    offsets: torch.Tensor | None = None  # int8 / q8_0 run W8A8: kernels.int8_gemm_offsets of its blocks

    @classmethod
    def quantize(cls, weight: torch.Tensor, kind: str, kernels: Any) -> "QuantizedWeight":
        """`weight` [N, K] float in format `kind`: "int8" quantizes it; q8_0 / q4_0 / q4_1 take it
        as the dequantized values of such blocks (see the module docstring). The k-quants come
        only from a GGUF's own blocks (`from_gguf`)."""
        n, k = weight.shape
        if kind in ("int8", "q8_0"):
            return cls._int8(kernels.int8_pack(*quantize_int8(weight, GGUF_GROUP if kind == "q8_0" else None)),
                             kind, n, k, kernels)
        if kind in ("q4_0", "q4_1"):
            return cls(kind, tuple(kernels.q4_pack(*q4_blocks(weight, kind))), n, k, kernels)
        if kind in KQUANT_BLOCK_BYTES:
            raise ValueError(f"format {kind!r} is served only from a GGUF file's own blocks, not quantized from floats")
        raise ValueError(f"unknown quantized format {kind!r}")

    @classmethod
    def from_gguf(cls, blocks: Any, kernels: Any) -> "QuantizedWeight":
        """A GGUF tensor's blocks (gguf_file.GGUFBlocks of a type in GGUF_SERVED) as they are:
        k-quant super-blocks kept bit for bit, Q8_0 / Q4_0 / Q4_1 unpacked into their formats'
        q, d (and m) exactly. Dequantizes to gguf-py's values bit for bit."""
        kind = GGUF_SERVED.get(blocks.gguf_type)
        n, k = blocks.shape
        if kind in KQUANT_BLOCK_BYTES:
            return cls(kind, (kernels.kquant_pack(blocks.raw, KQUANT_BLOCK_BYTES[kind]),), n, k, kernels)
        if kind == "q8_0":
            return cls._int8(kernels.int8_pack(*_q8_0_parts(blocks.raw, n)), kind, n, k, kernels)
        if kind in ("q4_0", "q4_1"):
            return cls(kind, tuple(kernels.q4_pack(*_q4_parts(blocks.raw, n, kind))), n, k, kernels)
        raise ValueError(f"GGUF type {blocks.gguf_type!r} is not served in its blocks (served: {', '.join(GGUF_SERVED)})")

    @classmethod
    def _int8(cls, packed: tuple[torch.Tensor, torch.Tensor], kind: str, n: int, k: int, kernels: Any) -> "QuantizedWeight":
        offsets = kernels.int8_gemm_offsets(*packed) if w8a8_available(kernels) else None
        return cls(kind, tuple(packed), n, k, kernels, offsets)

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=dtype) if out is None else out
        if self.kind in KQUANT_BLOCK_BYTES:
            return self.kernels.kquant_dequant_(out, *self.tensors)
        if len(self.tensors) == 2:
            return self.kernels.int8_dequant_(out, *self.tensors)
        return self.kernels.q4_dequant_(out, *self.tensors)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        any_rows = self.kind in KQUANT_BLOCK_BYTES or self._any_rows
        if any_rows and x.numel() > INT8_X_ROW_TILE * self.in_features:
            tiles = x.reshape(-1, self.in_features).split(INT8_X_ROW_TILE)
            return torch.cat([self.linear(t, bias) for t in tiles]).view(*x.shape[:-1], self.out_features)
        if self.kind in KQUANT_BLOCK_BYTES:  # int8 activations at any number of rows
            return self.kernels.kquant_linear(x, self.tensors[0], bias, self.out_features)
        if self.offsets is not None:  # W8A8 from 3 rows, int8_linear below them (the kernel library's choice)
            return self.kernels.packed_linear(x, self.skinny_tensors, bias, self.out_features)
        if any_rows or x.numel() <= self.skinny_rows * self.in_features:
            op = self.kernels.int8_linear if len(self.tensors) == 2 else self.kernels.q4_linear
            return op(x, *self.tensors, bias, self.out_features)
        weight = self.dequantize(x.dtype, _scratch_weight(self.out_features, self.in_features, x.dtype))
        return F.linear(x, weight, bias)

    @property
    def reads_rows(self) -> bool:
        """Whether `rows` can read single rows (k-quant blocks)."""
        return self.kind in KQUANT_BLOCK_BYTES

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` (int64, any shape) of the dequantized weight -> [*ids.shape, in_features],
        each exactly as `dequantize` gives it; k-quants only (`reads_rows`)."""
        if not self.reads_rows:
            raise ValueError(f"rows: {self.kind} weights are not read row by row")
        blocks = self.tensors[0]  # [ceil(N / 4), K / 256, 4, block bytes]
        flat = ids.reshape(-1)
        picked = blocks[flat // 4, :, flat % 4]  # [n, K / 256, block bytes]
        n, pad = flat.numel(), -flat.numel() % 4
        if pad:
            picked = torch.cat([picked, picked.new_zeros(pad, *picked.shape[1:])])
        packed = picked.view(-1, 4, *picked.shape[1:]).transpose(1, 2).contiguous()
        out = torch.empty(n + pad, self.in_features, dtype=dtype)
        self.kernels.kquant_dequant_(out, packed)
        return out[:n].view(*ids.shape, self.in_features)

    @property
    def skinny_rows(self) -> int:
        """Rows up to which `linear` runs the kernel library's GEMM on the blocks (k-quants and, on
        the AVX2 build, int8 / Q8_0 / Q4: any; this many in the one-call decoder layers)."""
        if self.kind in KQUANT_BLOCK_BYTES:
            return KQUANT_FUSED_MAX_ROWS
        if self.kind in ("q4_0", "q4_1") and self.kernels.q4_int8_activations:
            return INT8_X_MAX_ROWS
        if self._any_rows:
            return INT8_X_MAX_ROWS
        return SKINNY_MAX_ROWS

    @property
    def _any_rows(self) -> bool:
        """Whether `linear` runs the blocks' own kernel at any number of rows: on the AVX2 build,
        whose float GEMM is fp32 FMA, the integer dot products of int8 / Q8_0 (K and the scale
        groups whole runs of 32) and of Q4 stay ahead of dequantize-and-GEMM at every size a
        step takes (docs/quantization.md, "The kernels")."""
        if not self.kernels.int8_int8_activations:  # the AVX2 build's mark
            return False
        if self.kind in ("q4_0", "q4_1"):
            return True
        if self.kind not in ("int8", "q8_0"):
            return False
        groups = self.tensors[1].shape[1]
        return self.in_features % GGUF_GROUP == 0 and (self.in_features // groups) % GGUF_GROUP == 0

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
class StackedWeight:
    """Quantized weights stacked along the output features: a merged projection (q/k/v, gate/up)
    whose GGUF tensors are of different types, e.g. Q4_K_M's Q6_K attn_v beside Q4_K q and k. Each
    part computes its own features (its own kernel), concatenated; the kernel library's
    `packed_linear` does the same from `skinny_tensors`, so the one-call layers take it too."""

    parts: tuple[QuantizedWeight, ...]
    header: torch.Tensor  # int64 [parts, 2]: each part's count of skinny_tensors and out features

    @classmethod
    def of(cls, parts: list[QuantizedWeight]) -> "StackedWeight":
        header = torch.tensor([[len(p.skinny_tensors), p.out_features] for p in parts], dtype=torch.int64)
        return cls(tuple(parts), header)

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]: each part on its features (and its slice of the bias)."""
        outs, first = [], 0
        for part in self.parts:
            part_bias = None if bias is None else bias[first:first + part.out_features]
            outs.append(part.linear(x, part_bias))
            first += part.out_features
        return torch.cat(outs, dim=-1)

    def dequantize(self, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty(self.out_features, self.in_features, dtype=dtype) if out is None else out
        first = 0
        for part in self.parts:
            part.dequantize(dtype, out[first:first + part.out_features])
            first += part.out_features
        return out

    @property
    def skinny_rows(self) -> int:
        return min(p.skinny_rows for p in self.parts)

    @property
    def skinny_tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.header, *(t for p in self.parts for t in p.skinny_tensors))

    def with_skinny_tensors(self, tensors: tuple[torch.Tensor, ...]) -> "StackedWeight":
        parts, next_ = [], 1
        for part in self.parts:
            count = len(part.skinny_tensors)
            parts.append(part.with_skinny_tensors(tuple(tensors[next_:next_ + count])))
            next_ += count
        return StackedWeight(tuple(parts), tensors[0])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _fp16_field(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The fp16 at bytes [start, start + 2) of every block (raw [..., blocks, block bytes])."""
    return raw[..., start:start + 2].contiguous().view(torch.float16).squeeze(-1)


def _q8_0_parts(raw: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 blocks (fp16 d, 32 int8 q) -> (q int8 [N, K], d as fp32 [N, K / 32])."""
    blocks = raw.reshape(n, -1, 34)
    return blocks[..., 2:].contiguous().view(torch.int8).reshape(n, -1), _fp16_field(blocks, 0).float()


def _q4_parts(raw: torch.Tensor, n: int, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_0 (fp16 d, 16 bytes) / Q4_1 (fp16 d, m, 16 bytes) blocks -> (q uint8 [N, K] in [0, 15],
    d, m fp16 [N, K / 32]): value i of a block is byte i % 16's low nibble (i < 16) or high one.
    Q4_0's w = d (q - 8) is m = -8 d (exact in fp16)."""
    blocks = raw.reshape(n, -1, 18 if kind == "q4_0" else 20)
    d = _fp16_field(blocks, 0)
    m = (d.float() * -8).half() if kind == "q4_0" else _fp16_field(blocks, 2)
    qs = blocks[..., -16:]
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, -1), d, m


def quantize_module(name: str, module: Any, plan: QuantPlan | None, kernels: Any) -> Any:
    """`module`'s weight as the plan serves it (a QuantizedWeight or StackedWeight), or None to
    leave it to the float GEMMs. A module that got GGUF blocks at load (`gguf_segments`) packs
    those. Otherwise a GGUF format's tensor must come back bit for bit from its float values (see
    the module docstring), and its inputs must be whole blocks (a TP shard may cut one); else it
    stays in floats, with a warning."""
    if getattr(module, "gguf_segments", None):
        return _from_gguf_segments(name, module, kernels)
    kind = None if plan is None else (plan.head if getattr(module, "is_lm_head", False) else plan.layers)
    if kind is None or kernels is None or plan.gguf_tensors:  # a GGUF read from its blocks: the rest is floats
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


def _from_gguf_segments(name: str, module: Any, kernels: Any) -> Any:
    """The module's GGUF blocks ((first row, GGUFBlocks) for each of its checkpoint tensors) as one
    quantized weight, a StackedWeight where the types differ; or, where some of its rows came as
    floats (a type not served) or the kernels are missing, all of it dequantized into its weight
    (None, with a warning). The blocks (views of the file) are dropped either way, and their pages
    released from the resident memory (GGUFBlocks.release_pages)."""
    segments = sorted(module.gguf_segments, key=lambda seg: seg[0])
    module.gguf_segments = None
    rows = [blocks.shape[0] for _, blocks in segments]
    whole = [first for first, _ in segments] == [sum(rows[:i]) for i in range(len(rows))] \
        and sum(rows) == module.weight.shape[0]
    if kernels is not None and whole:
        weight = gguf_weight([blocks for _, blocks in segments], kernels)
        for _, blocks in segments:
            blocks.release_pages()
        return weight
    with torch.no_grad():
        for first, blocks in segments:
            module.weight[first:first + blocks.shape[0]].copy_(blocks.dequantize())
            blocks.release_pages()
    logger.warning("%s: %s; served dequantized", name, "the CPU kernel library is unavailable" if kernels is None
                   else "part of its rows are GGUF tensors of a type served in floats")
    return None


def gguf_weight(parts: list[Any], kernels: Any) -> QuantizedWeight | StackedWeight:
    """GGUF blocks stacked by rows (GGUFBlocks in output order) as one weight: runs of one type
    concatenated into a QuantizedWeight, a StackedWeight of them where the types change."""
    runs: list[list[Any]] = []
    for blocks in parts:
        if runs and runs[-1][0].gguf_type == blocks.gguf_type:
            runs[-1].append(blocks)
        else:
            runs.append([blocks])
    weights = [QuantizedWeight.from_gguf(_concat_rows(run), kernels) for run in runs]
    return weights[0] if len(weights) == 1 else StackedWeight.of(weights)


def _concat_rows(run: list[Any]) -> Any:
    return run[0].in_order() if len(run) == 1 else run[0].with_rows(torch.cat([b.in_order().raw for b in run]))
