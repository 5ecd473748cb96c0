"""llm-cluster vs llama.cpp at the model sizes users run (issue 44), on the same Q4_K_M files.

The files and their shapes (--shapes: llama-3.2-1b, qwen3-1.7b, llama-3.1-8b): benchmarks/
real_size_files.py (random weights of a named shape through llama.cpp's own converter and
llama-quantize, cached under `cluster.cache.cache_root()/real-sizes/<shape>/`).

Measured, 2 threads each (llama.cpp -t 2; torch's own thread count, the core count, for ours),
one engine at a time, each in a process of its own, on the same Q4_K_M file:
  decode B=1    generated tok/s, one sequence from a 1-token context. llama.cpp: `llama-bench
                -p <prefill-len> -n <steps> -t 2 -r <reps>` (tg, mean over reps). Ours: LLM (quantization=
                "gguf": the file's blocks), <steps> engine steps at batch 1 once the request
                decodes (step_profile.time_decode_steps), greedy sampling included.
  bandwidth     the decode step's floor: the file's bytes one step must read (every tensor but
                the embedding, which a token reads one row of; a tied head reads the embedding's
                bytes once as the head) over this machine's read bandwidth (step_profile.
                read_bandwidth: the best of 5 sums of a 1 GiB fp32 buffer on huge pages,
                measured in the worker just before its decode steps). Printed as ms per step and
                ours over it (the target: within 1.2x).
  prefill       one fresh prompt of <prefill-len> random tokens in one step: its tokens over the
                time to its first output token. llama.cpp: `llama-bench -p <prefill-len>` (pp, in
                the same call as tg). Ours: `LLM.generate` of it with max_tokens 1, best of 2.
  offline B     B requests of <in> random prompt tokens, <out> output tokens each: output
                tokens over the whole batch's wall time, prefill included. llama.cpp:
                `llama-batched-bench -npp <in> -ntg <out> -npl <B,...> -c <maxB x (in+out)>
                -b 2048 -ub 512 -t 2 -tb 2` (B x ntg over its T). Ours: `LLM.generate`
                (greedy, ignore_eos, max_num_seqs = the largest B, KV cache sized for it) once,
                after a warm-up batch.
  load (ours)   seconds to build LLM(...) (the file mapped and packed, kernels from the cache,
                KV cache allocated), the process's VmHWM (peak resident) and VmRSS after the
                load less its resident size before it, the bytes the model holds for its
                weights (every parameter and buffer, plus each layer's packed blocks), each
                against the file's size.
llama.cpp keeps its KV cache in f16, ours in bf16 (its activations fp32 with quantized layers).
Run it on a quiet machine: 2-thread llama.cpp spins at barriers and collapses (10x) when anything
else computes; --quick figures are a smoke test, not the measurement.
Every row prints ours, llama.cpp's and ours / llama.cpp's; everything goes to --json
(default <out-dir>/results.json), the tools' logs to <out-dir>/<shape>/.

    .venv/bin/python benchmarks/real_sizes.py --prepare-only [--shapes llama-3.1-8b]   # files only
    .venv/bin/python benchmarks/real_sizes.py --quick --shapes llama-3.2-1b          # smoke run
    .venv/bin/python benchmarks/real_sizes.py [--shapes llama-3.2-1b,llama-3.1-8b] [--batches 16,64]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from real_size_files import (QUANT, ROOT, SHAPES, THREADS, Shape, prepare_ours, prepare_shape,  # benchmarks/
                             shape_named)
from vs_llamacpp import LLAMA_CPP_PYTHON, batched_bench, build_llamacpp, llamacpp_commit, run_logged
from vs_vllm import ours_env


def step_bytes(gguf_path: Path) -> dict:
    """Bytes of the file one decode step reads: every tensor but the embedding (one row per
    token), the embedding's once as the head where no output.weight is stored (tied)."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + int(t.n_bytes)
    tied = "output.weight" not in sizes
    read = sum(n for k, n in sizes.items() if k != "token_embd.weight") + (sizes["token_embd.weight"] if tied else 0)
    return {"file_bytes": gguf_path.stat().st_size, "tensor_bytes": sum(sizes.values()), "step_bytes": read,
            "tied_head": tied, "bytes_by_type": types}


# ---- ours (in a process of its own: --ours-worker) --------------------------------------------
def proc_status() -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) * 1024
    return out


def model_bytes(model: Any) -> int:
    """Bytes the model holds for its weights: parameters and buffers (the rotary table included)
    and each layer's packed form (its blocks on huge pages, oneDNN's copy, a cache of either; an
    embedding's blocks)."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.nbytes
    for m in model.modules():
        for held in (getattr(m, "packed", None), getattr(m, "row_blocks", None)):  # row_blocks: an embedding's own
            if held is not None:
                total += held.nbytes
    return total


def kv_cache_bytes(shape: Shape, tokens: int) -> int:
    """bf16 K and V for `tokens` tokens, rounded up to 256 MiB."""
    need = 2 * 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * tokens
    return -(-need // (256 << 20)) * (256 << 20)


def ours_worker(args: argparse.Namespace, result: Path) -> None:
    import random

    import torch
    from step_profile import read_bandwidth, time_decode_steps  # benchmarks/

    from cluster import LLM, SamplingParams

    shape = shape_named(args.shape_name)
    top = max(args.batches, default=1)
    before = proc_status()
    t0 = time.perf_counter()
    tokens = max(top * (args.input_len + args.output_len + 32), args.prefill_len + 32)
    llm = LLM(args.model, max_num_seqs=top, max_model_len=max(2048, args.prefill_len + 32), quantization="gguf",
              max_num_batched_tokens=max(2048, args.prefill_len), kv_cache_memory=kv_cache_bytes(shape, tokens))
    load_s = time.perf_counter() - t0
    after = proc_status()
    runner = llm.engine.executor.worker.runner
    memory = {"load_s": load_s, "before": before, "after": after, "model_bytes": model_bytes(runner.model),
              "plan": str(llm.engine.config.model_config.quant_plan),
              "dtype": str(llm.engine.config.model_config.torch_dtype),
              "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    print(f"  ours: loaded in {load_s:.1f} s, peak RSS {after['VmHWM'] / 1e9:.2f} GB, RSS after "
          f"{after['VmRSS'] / 1e9:.2f} GB (before {before['VmRSS'] / 1e9:.2f}), model {memory['model_bytes'] / 1e9:.2f} GB",
          flush=True)

    vocab = llm.get_tokenizer().vocab_size

    def prompts(n: int, seed: int, length: int = args.input_len) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]

    def generate(batch: list[list[int]], max_tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        made = sum(len(o.outputs[0].token_ids) for o in outs)
        if made != len(batch) * max_tokens:
            raise SystemExit(f"ours: {made} output tokens at B={len(batch)}, expected {len(batch) * max_tokens}")
        return seconds

    generate(prompts(min(top, 4), 99), 4)  # warm-up: first-call allocations
    probe = read_bandwidth()
    bandwidth = probe()
    decode_s = time_decode_steps(llm.engine, 1, args.decode_steps, prompt_len=1)
    prefill = {}
    if args.prefill_len:  # one fresh prompt in one step (llama-bench -p), the best of 2
        seconds = min(generate(prompts(1, 1000 + i, args.prefill_len), 1) for i in range(2))
        prefill = {"tokens": args.prefill_len, "tok_s": args.prefill_len / seconds}
        print(f"  ours prefill {args.prefill_len}: {prefill['tok_s']:.1f} tok/s", flush=True)
    offline = {}
    for b in args.batches:
        seconds = generate(prompts(b, b), args.output_len)
        offline[b] = {"seconds": seconds, "tok_s": b * args.output_len / seconds}
        print(f"  ours B={b}: {offline[b]['tok_s']:.1f} tok/s", flush=True)
    result.write_text(json.dumps({"memory": memory, "read_bytes_s": bandwidth, "torch_threads": torch.get_num_threads(),
                                  "decode_b1": {"steps": args.decode_steps, "tok_s": args.decode_steps / decode_s},
                                  "prefill": prefill, "offline": offline}))


def run_ours(args: argparse.Namespace, name: str, model: Path, out_dir: Path) -> dict:
    result = out_dir / "ours.json"
    cmd = [sys.executable, __file__, "--ours-worker", str(result), "--shape-name", name, "--model", str(model),
           "--batches", ",".join(map(str, args.batches)), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--decode-steps", str(args.decode_steps),
           "--prefill-len", str(args.prefill_len)]
    subprocess.run(cmd, cwd=ROOT, env=ours_env(), check=True)
    return json.loads(result.read_text())


# ---- llama.cpp --------------------------------------------------------------------------------
def run_llamacpp(args: argparse.Namespace, bin_dir: Path, model: Path, out_dir: Path) -> dict:
    """llama-bench's tg (batch-1 decode) and pp (prefill), and llama-batched-bench's batches."""
    out = run_logged([str(bin_dir / "llama-bench"), "-m", str(model), "-p", str(args.prefill_len),
                      "-n", str(args.decode_steps), "-t", THREADS, "-r", str(args.bench_reps), "-o", "json"],
                     out_dir / "llama-bench.log")
    tests = json.loads(out)
    (tg,) = [t for t in tests if t["n_gen"]]
    decode = {"steps": args.decode_steps, "tok_s": tg["avg_ts"], "stddev": tg["stddev_ts"]}
    print(f"  llama.cpp decode B=1: {decode['tok_s']:.2f} tok/s", flush=True)
    pp = next((t for t in tests if t["n_prompt"] and not t["n_gen"]), None)  # none with --prefill-len 0
    prefill = {} if pp is None else {"tokens": pp["n_prompt"], "tok_s": pp["avg_ts"], "stddev": pp["stddev_ts"]}
    if prefill:
        print(f"  llama.cpp prefill {pp['n_prompt']}: {prefill['tok_s']:.1f} tok/s", flush=True)
    offline = {}
    if args.batches:
        offline = batched_bench(bin_dir, str(model), args, out_dir)
    return {"decode_b1": decode, "prefill": prefill, "offline": offline}


# ---- report -------------------------------------------------------------------------------------
def rows_of(name: str, res: dict) -> list[dict]:
    ours, theirs, files = res["ours"], res["llama.cpp"], res["file"]
    rows = [{"measurement": f"{name} decode B=1 tok/s", "ours": ours["decode_b1"]["tok_s"],
             "llama.cpp": theirs["decode_b1"]["tok_s"]}]
    if ours.get("prefill"):
        rows.append({"measurement": f"{name} prefill {ours['prefill']['tokens']} tok/s",
                     "ours": ours["prefill"]["tok_s"], "llama.cpp": theirs.get("prefill", {}).get("tok_s", float("nan"))})
    for b, o in ours["offline"].items():
        rows.append({"measurement": f"{name} offline B={b} tok/s", "ours": o["tok_s"],
                     "llama.cpp": theirs["offline"][b]["tok_s"]})
    for row in rows:
        row["ratio"] = row["ours"] / row["llama.cpp"]
    limit_ms = files["step_bytes"] / ours["read_bytes_s"] * 1e3
    step_ms = 1e3 / ours["decode_b1"]["tok_s"]
    mem, size = ours["memory"], files["file_bytes"]
    res["summary"] = {
        "bandwidth_limit_ms": limit_ms, "read_gb_s": ours["read_bytes_s"] / 1e9, "ours_step_ms": step_ms,
        "ours_over_limit": step_ms / limit_ms, "llamacpp_over_limit": 1e3 / theirs["decode_b1"]["tok_s"] / limit_ms,
        "load_s": mem["load_s"], "file_gb": size / 1e9,
        "peak_rss_gb": mem["after"]["VmHWM"] / 1e9, "peak_over_file": mem["after"]["VmHWM"] / size,
        "load_added_rss_gb": (mem["after"]["VmRSS"] - mem["before"]["VmRSS"]) / 1e9,
        "model_gb": mem["model_bytes"] / 1e9, "model_over_file": mem["model_bytes"] / size}
    return rows


def report(results: dict) -> None:
    commit = results["llama.cpp"]["commit"]
    print(f"\nllama.cpp {commit[:7] if commit else 'not run'} (llama-cpp-python {LLAMA_CPP_PYTHON}), {QUANT} "
          f"made by {results['maker']}, "
          f"{THREADS} threads")
    print(f"\n{'measurement':<34} | {'ours':>9} | {'llama.cpp':>9} | ratio (ours / llama.cpp)")
    for row in results["rows"]:
        print(f"{row['measurement']:<34} | {row['ours']:9.2f} | {row['llama.cpp']:9.2f} | {row['ratio']:.2f}x")
    for name, res in results["shapes"].items():
        s = res["summary"]
        print(f"\n{name}: file {s['file_gb']:.2f} GB; bandwidth limit {s['bandwidth_limit_ms']:.1f} ms/step "
              f"({res['file']['step_bytes'] / 1e9:.2f} GB at {s['read_gb_s']:.1f} GB/s): ours {s['ours_step_ms']:.1f} ms "
              f"({s['ours_over_limit']:.2f}x), llama.cpp {s['llamacpp_over_limit']:.2f}x")
        print(f"  ours load {s['load_s']:.1f} s, peak RSS {s['peak_rss_gb']:.2f} GB ({s['peak_over_file']:.2f}x the "
              f"file), RSS added by the load {s['load_added_rss_gb']:.2f} GB, weights held {s['model_gb']:.2f} GB "
              f"({s['model_over_file']:.2f}x the file)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama-3.2-1b,llama-3.1-8b", help=f"comma-separated, of {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="16,64", help="offline batch sizes B (empty: none)")
    ap.add_argument("--input-len", type=int, default=128, help="offline prompt tokens")
    ap.add_argument("--output-len", type=int, default=128, help="offline output tokens")
    ap.add_argument("--decode-steps", type=int, default=128, help="batch-1 decode: tokens timed (llama-bench -n)")
    ap.add_argument("--prefill-len", type=int, default=512, help="prefill: one prompt's tokens (llama-bench -p); 0: none")
    ap.add_argument("--bench-reps", type=int, default=5, help="llama-bench -r")
    ap.add_argument("--seed", type=int, default=0, help="the random checkpoint's seed (a new seed: delete the cache)")
    ap.add_argument("--keep", action="store_true", help="keep the HF checkpoint and the bf16 GGUF")
    ap.add_argument("--out-dir", default="build/real-sizes", help="logs and results")
    ap.add_argument("--json", help="results file (default: <out-dir>/results.json)")
    ap.add_argument("--quick", action="store_true", help="smoke run: B 16; 16 tokens in, out and decoded; -r 1")
    ap.add_argument("--prepare-only", action="store_true", help="build llama.cpp and make the files, then stop")
    ap.add_argument("--skip-llamacpp", action="store_true", help="ours only (the llama.cpp rows read nan)")
    ap.add_argument("--maker", choices=("llama.cpp", "ours"), default="llama.cpp",
                    help="who writes the Q4_K_M files: llama.cpp's converter and llama-quantize, or write_ours "
                         "(no llama.cpp needed; ours only: implies --skip-llamacpp)")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--shape-name", help=argparse.SUPPRESS)
    ap.add_argument("--ours-worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.batches = "16"
        args.input_len = args.output_len = args.decode_steps = args.prefill_len = 16
        args.bench_reps = 1
    args.batches = [int(b) for b in args.batches.split(",") if b]
    shapes = [s for s in args.shapes.split(",") if s]
    for s in shapes:
        shape_named(s)
    sys.path.insert(0, str(ROOT))  # this checkout's cluster package
    if args.ours_worker:
        ours_worker(args, Path(args.ours_worker))
        return
    if args.maker == "ours":
        args.skip_llamacpp, bin_dir = True, None
        files = {s: prepare_ours(s, args.seed) for s in shapes}
    else:
        bin_dir = build_llamacpp()
        files = {s: prepare_shape(s, bin_dir, args.seed, args.keep) for s in shapes}
    if args.prepare_only:
        print("\n".join(f"{s}: {p} ({p.stat().st_size / 1e9:.2f} GB)" for s, p in files.items()))
        return
    out_root = (ROOT / args.out_dir).resolve()
    results = {"params": {k: getattr(args, k) for k in ("batches", "input_len", "output_len", "decode_steps", "prefill_len",
                                                         "bench_reps", "quick", "seed")},
               "maker": args.maker,
               "llama.cpp": {"version": LLAMA_CPP_PYTHON, "bin": str(bin_dir),
                             "commit": None if args.skip_llamacpp else llamacpp_commit()},
               "cpu": cpu_name(), "date": time.strftime("%Y-%m-%d"), "shapes": {}}
    for s, path in files.items():
        out_dir = out_root / s
        out_dir.mkdir(parents=True, exist_ok=True)
        res = {"path": str(path), "shape": asdict(SHAPES[s]), "file": step_bytes(path)}
        print(f"--- {s}: ours", flush=True)
        res["ours"] = run_ours(args, s, path, out_dir)
        if args.skip_llamacpp:
            zero = {"tok_s": float("nan")}
            res["llama.cpp"] = {"decode_b1": zero, "prefill": zero, "offline": {b: zero for b in args.batches}}
        else:
            print(f"--- {s}: llama.cpp", flush=True)
            res["llama.cpp"] = run_llamacpp(args, bin_dir, path, out_dir)
        results["shapes"][s] = json.loads(json.dumps(res))  # int keys become strings, as the file has them
    results["rows"] = [row for s, res in results["shapes"].items() for row in rows_of(s, res)]
    path = Path(args.json) if args.json else out_root / "results.json"
    path.write_text(json.dumps(results, indent=1))
    report(results)
    print(f"\nresults: {path}")


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip() + f", {os.cpu_count()} cores"
    return "unknown"


if __name__ == "__main__":
    main()
