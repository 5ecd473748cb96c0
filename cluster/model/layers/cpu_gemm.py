"""bf16 linear layers on CPU with the weight reordered once, after loading, into the layouts
the CPU GEMMs read.

`F.linear` hands oneDNN the weight in its checkpoint layout on every call. Reordering it once
into oneDNN's blocked layout (what its AMX / AVX-512-BF16 kernels read) made SmolLM2's decode
GEMMs 1.5-2.5x faster on this project's Xeon at batch 1-128, and prefill-sized ones no slower,
with bit-identical results (`tests/test_cpu_layer_ops.py` asserts equality).

fp32 weights (the default dtype where the CPU lacks fast bf16, e.g. an AVX2-only EPYC) go the
same way where oneDNN's fp32 GEMM on the reordered weight beats `F.linear` (MKL's sgemm, which
reads the checkpoint layout) on this CPU: `fp32_gemm` times both once per process; results
differ from F.linear's in the last bits (another summation order), as the attention kernel's
already do. With the kernel library an fp32 weight gets the skinny layout below too, whichever
GEMM the timing gave its many rows (and so its model the fused decode layers: a close timing
cannot take them away; LLM_CLUSTER_CPU_GEMM=aten still leaves fp32 weights as loaded). It takes
up to `fp32_skinny_rows` rows, where the skinny kernel streams fp32 weights faster than either
(docs/cpu_kernels.md, "Packed fp32 linears"), so a speculative step's k + 1 rows, and on AVX2
decode batches up to 64, stay on the fused layers.

For a few rows (decode at batch 1-3) the kernel library's `skinny_linear` reads a second copy of
the weight in its own layout at memory speed, where oneDNN streamed it at ~60% of that
(csrc/skinny_gemm_cpu.cpp). The copy costs the weight's size again: what single-stream decode
speed is bought with. Its sums run in another order than oneDNN's, so in bf16 a row's result can
differ in the last bit between the two: a request's greedy tokens can depend on how many rows
its steps had (as they already did on the attention path a prefix-cache hit takes), as with
vLLM's kernels.

For more rows there are two GEMMs, and one of them is kept per process (`many_rows_gemm`):
oneDNN's, which runs bf16 dot products (vdpbf16ps) or AMX, and the kernel library's `fma_linear`,
which widens the weight to fp32 in registers and multiplies with FMAs (csrc/fma_gemm_cpu.cpp).
Which is faster depends on the CPU: on the project's 2-core Xeon (AVX512-BF16, no AMX) vdpbf16ps
retires a quarter as often as an FMA and oneDNN sat at ~165 GFLOP/s on SmolLM2's shapes where
fma_linear reaches ~280 (1.5-1.7x at 13 to 2048 rows); with AMX, or on Zen 4, oneDNN's bf16
paths are the fast ones. So the first weight packed times both on a 64 x 576 x 1536 problem and
the weights get only the winner's layout (the memory is the same either way);
LLM_CLUSTER_CPU_GEMM=onednn or fma sets it. fma_linear sums in input order, oneDNN in its own:
their results can differ in the last bf16 bit.

oneDNN takes bf16 weights in its blocked layout only with AVX-512 BW/VL/DQ or AVX-NE-CONVERT
(`onednn_packs_bf16`), and without them `F.linear` in bf16 is ATen's slow path (4-5x the skinny
kernel's time at 4 to 512 rows on an AVX2-only EPYC). On such a CPU a bf16 weight with the kernel
library keeps only its skinny layout and takes it at every number of rows; the plain weight is
released (a tied head's stays with its embedding). Asked for ("aten") where oneDNN packs bf16,
F.linear takes the rows past SKINNY_MAX_ROWS as before.
"""
from __future__ import annotations

import logging
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.huge_pages import Arena

# Rows of x up to which a bf16 `PackedWeight.linear` runs skinny_linear instead of the many-rows
# GEMM: it streams the weights at ~32 GB/s at 1-2 rows and ~27 at 3 on an EPYC, oneDNN at ~20; from
# 4 rows its fp32 FMAs fall behind oneDNN's bf16 dot products (SmolLM2's 120 layer GEMMs, two threads).
SKINNY_MAX_ROWS = 3
# The same for fp32 weights beside oneDNN's fp32 GEMM, by the kernel library's instruction set.
# AVX2: the skinny kernel (three rows a pass) is faster than oneDNN up to ~64 rows, where it is
# level and the fused decoder layers it opens save the modular layers' dispatch
# (benchmarks/cpu_gemm_rows.py; docs/cpu_kernels.md, "Packed fp32 linears"). Elsewhere
# (AVX-512) the last measured crossover, between 8 and 12 rows, stands.
FP32_SKINNY_MAX_ROWS = {"avx2": 64, "avx512": 8, "scalar": 8}
# Every number of rows: a bf16 weight where the many-rows GEMM would be ATen's slow bf16 path.
SKINNY_EVERY_ROW = sys.maxsize
GEMM_ENV = "LLM_CLUSTER_CPU_GEMM"
GEMMS = ("auto", "onednn", "fma", "aten")
logger = logging.getLogger(__name__)
_chosen: str | None = None  # many_rows_gemm's answer, once per process
_chosen_fp32: str | None = None  # fp32_gemm's


def onednn_packs_bf16() -> bool:
    """Whether oneDNN takes a bf16 weight in its blocked layout on this CPU (torch's own check:
    AVX-512 BW/VL/DQ, or AVX-NE-CONVERT)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def can_pack(weight: torch.Tensor, kernels: Any = None) -> bool:
    """Whether `PackedWeight.of(weight, kernels)` gives `weight` a faster layout here: a 2-D CPU
    weight, bf16 where the kernel library (its skinny GEMM) is loaded or oneDNN packs bf16; fp32
    where `fp32_gemm` is oneDNN's, or chose F.linear by timing with the kernel library loaded
    (LLM_CLUSTER_CPU_GEMM=aten leaves fp32 weights as loaded)."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return False
    if weight.dtype == torch.float32:
        return fp32_gemm() == "onednn" or (kernels is not None and _asked_gemm() != "aten")
    return weight.dtype == torch.bfloat16 and (kernels is not None or onednn_packs_bf16())


@dataclass(frozen=True)
class PackedWeight:
    """A [out, in] bf16 weight in the layout of the many-rows GEMM `many_rows_gemm` chose (oneDNN's
    blocked one, `fma_pack`'s, or the plain weight for `F.linear`) and, when the kernel library is
    loaded, its skinny layout too. `linear` equals `F.linear(x, weight, bias)`: bit-identical on
    oneDNN's and ATen's paths, the same products summed in another order (fp32, one rounding) on
    the kernel library's. Where oneDNN cannot pack bf16 the skinny layout alone serves every row
    count. An fp32 weight has the skinny layout and oneDNN's or the plain one (`fp32_gemm`), its
    results F.linear's but for the summation order. `skinny_rows`: up to how many rows of x
    `linear` takes the skinny GEMM."""

    onednn: torch.Tensor | None
    out_features: int
    in_features: int
    skinny: torch.Tensor | None = None
    kernels: Any = None  # CpuKernels, with skinny
    fma: torch.Tensor | None = None  # fma_pack's layout, where fma_linear is the many-rows GEMM
    plain: torch.Tensor | None = None  # the weight itself, where F.linear ("aten") is
    skinny_rows: int = 0  # 0 without a skinny layout

    @classmethod
    def of(cls, weight: torch.Tensor, kernels: Any = None) -> "PackedWeight":
        weight = weight.detach().contiguous()
        out_features, in_features = weight.shape
        skinny = kernels.skinny_pack(weight) if kernels is not None else None
        if weight.dtype == torch.float32:  # the skinny layout beside oneDNN's or the plain weight (fp32_gemm)
            rows = fp32_skinny_rows(kernels) if skinny is not None else 0
            if fp32_gemm() == "aten":
                return cls(None, out_features, in_features, skinny, kernels, plain=weight, skinny_rows=rows)
            return cls(torch.ops.mkldnn._reorder_linear_weight(weight, None), out_features, in_features, skinny, kernels,
                       skinny_rows=rows)
        gemm = many_rows_gemm(kernels)
        rows = 0 if skinny is None else SKINNY_MAX_ROWS
        if gemm == "fma":
            return cls(None, out_features, in_features, skinny, kernels, fma=kernels.fma_pack(weight), skinny_rows=rows)
        if gemm == "aten" and skinny is not None and not onednn_packs_bf16():  # the skinny layout is all it needs
            return cls(None, out_features, in_features, skinny, kernels, skinny_rows=SKINNY_EVERY_ROW)
        if gemm == "aten":
            return cls(None, out_features, in_features, skinny, kernels, plain=weight, skinny_rows=rows)
        onednn = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        return cls(onednn, out_features, in_features, skinny, kernels, skinny_rows=rows)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., in] -> [..., out]."""
        if self.skinny is not None and x.numel() // self.in_features <= self.skinny_rows:
            return self.kernels.skinny_linear(x, self.skinny, bias, self.out_features)
        if self.fma is not None:
            return self.kernels.fma_linear(x, self.fma, bias, self.out_features)
        if self.plain is not None:
            return F.linear(x, self.plain, bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.onednn, bias, "none", [], "")

    @property
    def skinny_tensors(self) -> tuple[torch.Tensor, ...]:
        """The weight as the kernel library's `packed_linear` reads it."""
        return (self.skinny,)

    def with_skinny_tensors(self, tensors: tuple[torch.Tensor, ...]) -> "PackedWeight":
        """The same weight with its skinny form in `tensors` (copies of `skinny_tensors`)."""
        return replace(self, skinny=tensors[0])

    @property
    def nbytes(self) -> int:
        """Bytes resident: the many-rows GEMM's copy (oneDNN's: its logical size) and the skinny one."""
        return sum(t.numel() * t.element_size() for t in (self.onednn, self.fma, self.plain, self.skinny)
                   if t is not None)


def fp32_skinny_rows(kernels: Any) -> int:
    """Up to how many rows an fp32 weight's `linear` takes skinny_linear with these kernels."""
    return FP32_SKINNY_MAX_ROWS[kernels.isa]


def many_rows_gemm(kernels: Any = None) -> str:
    """"onednn", "fma" or "aten": the GEMM bf16 weights take past SKINNY_MAX_ROWS rows in this
    process. $LLM_CLUSTER_CPU_GEMM (auto, onednn, fma or aten) sets it; "auto" (the default) times
    oneDNN's and fma_linear once, on the first call with the kernel library, and keeps fma_linear
    if it took under 0.85x oneDNN's time. Without the library's AVX-512 build it is oneDNN; where
    oneDNN cannot pack bf16 (or asked), "aten": `F.linear` on the plain weight."""
    global _chosen
    asked = _asked_gemm()
    if asked == "aten":
        return asked
    fallback = "onednn" if onednn_packs_bf16() else "aten"
    if kernels is None or not kernels.has_fma_gemm or asked == "onednn":
        return fallback
    if asked == "fma" or fallback == "aten":
        return "fma"
    if _chosen is None:
        fma_ms, onednn_ms = _time_gemms(kernels)
        _chosen = "fma" if fma_ms < 0.85 * onednn_ms else "onednn"
        logger.info("bf16 GEMMs past %d rows: %s (64 x 576 x 1536: fma_linear %.3f ms, oneDNN %.3f ms)",
                    SKINNY_MAX_ROWS, _chosen, fma_ms, onednn_ms)
    return _chosen


def _asked_gemm() -> str:
    asked = os.environ.get(GEMM_ENV, "auto")
    if asked not in GEMMS:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(GEMMS)}, got {asked!r}")
    return asked


def fp32_gemm() -> str:
    """"onednn" or "aten": the GEMM fp32 weights take in this process (`F.linear` on the weight
    as loaded is "aten"). $LLM_CLUSTER_CPU_GEMM=onednn or aten names it; otherwise ("auto", or
    "fma", which has no fp32 form) both are timed once, on a SmolLM2 layer's four GEMMs at 64 rows,
    and oneDNN is kept if it took under 0.9x F.linear's time."""
    global _chosen_fp32
    asked = _asked_gemm()
    if asked == "aten" or not torch.backends.mkldnn.is_available():
        return "aten"
    if asked == "onednn":
        return "onednn"
    if _chosen_fp32 is None:
        aten_ms, onednn_ms = _time_fp32_gemms()
        _chosen_fp32 = "onednn" if onednn_ms < 0.9 * aten_ms else "aten"
        logger.info("fp32 GEMMs: %s (a SmolLM2 layer's four at 64 rows: F.linear %.3f ms, oneDNN %.3f ms)",
                    _chosen_fp32, aten_ms, onednn_ms)
    return _chosen_fp32


def _time_fp32_gemms(rounds: int = 5) -> tuple[float, float]:
    """Median ms of F.linear and of oneDNN on its reordered weights, over SmolLM2's qkv, o,
    gate_up and down projections at 64 rows, alternated."""
    gen = torch.Generator().manual_seed(0)
    shapes = ((960, 576), (576, 576), (3072, 576), (576, 1536))
    weights = [torch.randn(shape, generator=gen) for shape in shapes]
    xs = [torch.randn(64, shape[1], generator=gen) for shape in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    medians = _alternate({"aten": (lambda: [F.linear(x, w) for x, w in zip(xs, weights)]),
                          "onednn": (lambda: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                              for x, p in zip(xs, packed)])}, rounds, calls=1)
    return medians["aten"], medians["onednn"]


def _time_gemms(kernels: Any, rounds: int = 5, calls: int = 4) -> tuple[float, float]:
    """Median ms of fma_linear and of oneDNN's GEMM on one SmolLM2-sized problem, alternated."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1536, 576, generator=gen).bfloat16()
    x = torch.randn(64, 576, generator=gen).bfloat16()
    fma, onednn = kernels.fma_pack(weight), torch.ops.mkldnn._reorder_linear_weight(weight, None)
    medians = _alternate({"fma": (lambda: kernels.fma_linear(x, fma, None, 1536)),
                          "onednn": (lambda: torch.ops.mkldnn._linear_pointwise(x, onednn, None, "none", [], ""))},
                         rounds, calls)
    return medians["fma"], medians["onednn"]


def _alternate(runs: dict[str, Callable[[], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median ms per call of each run, the runs taking turns (a warm-up call before each turn),
    so a neighbour's load on a shared machine falls on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(rounds):
        for name, run in runs.items():
            run()
            start = time.perf_counter()
            for _ in range(calls):
                run()
            times[name].append((time.perf_counter() - start) / calls * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def pack_linears(model: nn.Module, kernels: Any = None, plan: Any = None, floats: bool = True) -> int:
    """Give every layer with a `pack_weight(packed, release)` method (linears, the LM head) its
    weight in the CPU GEMMs' layouts: where the quant_plan.QuantPlan `plan` says so (and with
    `kernels`) a QuantizedWeight, else, where `floats` and the weight `can_pack`, a PackedWeight
    (with `kernels`, its skinny layout too). Returns how many. A weight another module also uses
    (a head tied to the embedding) keeps its plain copy; the others are released."""
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
        elif floats and can_pack(weight, kernels):
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
