"""int8 weights against bf16 on one of benchmarks/real_sizes.py's random-weight shapes, ours only,
in one process: both engines loaded side by side and run in turn on vs_vllm.py's offline
workloads (greedy, ignore_eos), so the host's drift (this VM's speed moves by up to 1.6x within
an hour) falls on every variant alike.

Variants, each run `--repeats` times in the order bf16, int8, int8 without AMX, ...:
  bf16          dtype bf16
  int8          quantization="int8", as served by default (dtype auto), W8A8 from 3 rows a step;
                on AMX tiles from 24 rows where the CPU has AMX-INT8 (int8_gemm_cpu.cpp)
  int8-no-amx   the same engine with LLM_CLUSTER_INT8_AMX=0: the VNNI kernel at every size
                (only where the CPU has AMX-INT8; elsewhere it is the int8 row)
Prints each variant's best and median output tok/s and the ratios to bf16.

    .venv/bin/python benchmarks/int8_vs_bf16.py [--shape llama-3.2-1b] [--workloads short]
        [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vs_vllm import WORKLOADS, make_workloads, shape_hf_folder  # noqa: E402


def _engine(model: Path, args, **kw):
    from cluster import LLM

    return LLM(str(model), max_num_seqs=args.max_num_seqs, max_model_len=2048,
               kv_cache_memory=int(args.kv_cache_gib * (1 << 30)), **kw)


def _run(llm, workload: dict) -> float:
    from cluster import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in workload["output_lens"]]
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in workload["prompts"]], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(workload["output_lens"]), (produced, sum(workload["output_lens"]))
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.2-1b", help="a benchmarks/real_sizes.py shape")
    ap.add_argument("--workloads", default="short", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--kv-cache-gib", type=float, default=2)
    ap.add_argument("--json", help="results file")
    args = ap.parse_args()

    from cluster.kernels.cpu_kernels import load

    kernels = load()
    amx = bool(kernels and kernels.has_int8_amx)
    model = shape_hf_folder(args.shape)
    workloads = make_workloads({w: WORKLOADS[w] for w in args.workloads.split(",")})
    engines = {"bf16": _engine(model, args, dtype="bfloat16"), "int8": _engine(model, args, quantization="int8")}
    variants = ["bf16", "int8"] + (["int8-no-amx"] if amx else [])
    for name, w in workloads.items():  # warm-up: allocations, the kernels' first calls
        for llm in engines.values():
            _run(llm, {"prompts": w["prompts"][:16], "output_lens": [8] * 16})
    results: dict = {"shape": args.shape, "int8_amx": amx, "threads": os.cpu_count(), "tok_s": {}}
    for name, w in workloads.items():
        runs: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.repeats):
            for v in variants:
                os.environ["LLM_CLUSTER_INT8_AMX"] = "0" if v == "int8-no-amx" else "1"
                runs[v].append(_run(engines[v.removesuffix("-no-amx")], w))
                print(f"{name} {v}: {runs[v][-1]:.1f} tok/s", flush=True)
        os.environ.pop("LLM_CLUSTER_INT8_AMX")
        results["tok_s"][name] = runs
        best = {v: max(r) for v, r in runs.items()}
        for v in variants:
            print(f"== {name} {v:12s} best {best[v]:7.1f}  median {statistics.median(runs[v]):7.1f} tok/s  "
                  f"best / bf16 {best[v] / best['bf16']:.2f}x", flush=True)
        if amx:
            print(f"== {name} int8 AMX / no AMX: {best['int8'] / best['int8-no-amx']:.2f}x", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
