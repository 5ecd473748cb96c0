"""fp32 linear layers on CPU by number of rows: the kernel library's skinny GEMM against oneDNN's on
its reordered weights (and optionally F.linear), SmolLM2-135M's 120 layer GEMMs (qkv 960 x 576,
o 576 x 576, gate_up 3072 x 576, down 576 x 1536, 30 layers), two threads.

"streamed": 30 layers of distinct weights (0.43 GB), so every pass reads them from memory as a
decode step does; "cached": one layer's four weights called 30 times, so what is measured is the
kernels' arithmetic. The GEMMs alternate in one process, median of --repeats sweeps each. This is
the measurement behind `cpu_gemm.FP32_SKINNY_MAX_ROWS` (up to how many rows fp32 weights take the
skinny kernel, and fp32 models the fused decoder layers).

    .venv/bin/python benchmarks/cpu_gemm_rows.py [--rows 1,2,4,8,16,32,48,64,128] [--repeats 7]
                                                 [--aten] [--out results.txt]
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from cluster.kernels.cpu_kernels import load

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30


def onednn_linear(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linears(weights: list[torch.Tensor], kernels, aten: bool) -> dict[str, list[Callable[[torch.Tensor], object]]]:
    """Per kind of GEMM, one function x -> x @ w^T for each weight."""
    kinds = {
        "skinny": [partial(kernels.skinny_linear, packed=kernels.skinny_pack(w), bias=None, out_features=w.shape[0])
                   for w in weights],
        "oneDNN": [partial(onednn_linear, torch.ops.mkldnn._reorder_linear_weight(w, None)) for w in weights],
    }
    if aten:
        kinds["F.linear"] = [partial(F.linear, weight=w) for w in weights]
    return kinds


def sweep(fns: list[Callable[[torch.Tensor], object]], xs: list[torch.Tensor], times: int) -> float:
    """Seconds for every weight's GEMM in turn, the list `times` over."""
    t0 = time.perf_counter()
    for _ in range(times):
        for fn, x in zip(fns, xs):
            fn(x)
    return time.perf_counter() - t0


def measure(name: str, weights: list[torch.Tensor], times: int, kernels, rows: list[int], repeats: int,
            aten: bool) -> list[str]:
    lines = []
    kinds = linears(weights, kernels, aten)
    for m in rows:
        by_width = {k: torch.randn(m, k) for k in {w.shape[1] for w in weights}}
        xs = [by_width[w.shape[1]] for w in weights]
        for fns in kinds.values():
            sweep(fns, xs, times)
        spent: dict[str, list[float]] = {kind: [] for kind in kinds}
        for _ in range(repeats):
            for kind, fns in kinds.items():
                spent[kind].append(sweep(fns, xs, times))
        med = {kind: statistics.median(t) * 1e3 for kind, t in spent.items()}
        cells = "  ".join(f"{kind} {ms:7.1f} ms" for kind, ms in med.items())
        line = f"{name:<8} rows {m:4d}  {cells}  skinny / oneDNN {med['skinny'] / med['oneDNN']:.2f}"
        print(line, flush=True)
        lines.append(line)
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,32,48,64,128")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--aten", action="store_true", help="F.linear on the weights as loaded too")
    ap.add_argument("--skip-cached", action="store_true")
    ap.add_argument("--out", help="also write the lines here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernels = load()
    if kernels is None:
        raise SystemExit("the CPU kernel library did not build here (see the log)")
    rows = [int(r) for r in args.rows.split(",")]
    gen = torch.Generator().manual_seed(0)
    header = f"# {kernels.isa} build, {args.threads} threads, SmolLM2's 120 layer GEMMs, fp32, medians of {args.repeats}"
    print(header)
    lines = [header]
    streamed = [torch.randn(s, generator=gen) for _ in range(LAYERS) for s in SHAPES]
    lines += measure("streamed", streamed, 1, kernels, rows, args.repeats, args.aten)
    del streamed
    if not args.skip_cached:
        one = [torch.randn(s, generator=gen) for s in SHAPES]
        lines += measure("cached", one, LAYERS, kernels, rows, args.repeats, args.aten)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
