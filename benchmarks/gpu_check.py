"""GPU check: llm-cluster on a CUDA device, against HF transformers on the same device, same run.

Checks (pick with --checks; each merges its figures into <out-dir>/gpu-<device>.json):
  parity      SmolLM2 fp32, TF32 off: greedy, 10 chat prompts x 48 tokens, CUDA graphs on,
              token-identical to HF transformers; graphs on vs off (enforce_eager) identical.
              Then the KV tier on CUDA (gpu_kv_tier.py): a pool too small for four 5-turn
              conversations, greedy tokens equal with the tier (shared memory spilling to disk)
              on and off, plain and async scheduling; tier hits, reads and writes counted
              (kv_tier, kv_tier_ok).
  throughput  nano-vLLM's workload: 256 sequences, random prompt and output lengths 100-1024,
              random token ids, ignore_eos, temperature 0.6; for SmolLM2 (bf16) and a
              random-weight model shaped like Llama-3-8B (bf16, load_format=dummy). HF
              transformers runs the same requests in static batches (sorted by length) at each
              batch size given; its best batch size is the peer figure. Ours runs again with
              async_scheduling=True (the in-process worker on its own thread): ours_async.
  roofline    device-to-device copy bandwidth measured in this run; pure-decode steps at 1
              (batch1) and 256 sequences (roofline) timed per engine step; the bytes a step
              must move (weights + the KV it reads) over that bandwidth is the ideal step time;
              roofline_fraction = ideal / ours. Then the same steps under torch.profiler
              (profile_batch1, profile_256): device time a step by kernel (top kernels,
              attention and GEMM shares) against the step's wall time; host_gap_ms is the
              host time the GPU waits for. Then prefill (8 x 2,048 tokens: model TFLOP/s
              against a bf16 8192^3 GEMM timed in the same run).
  serve       (gpu_serve.py) `python -m actors.serve_cli` on deploy.yaml with `preset: gpu`: a
              chat request, the same streamed (equal text), and a JSON-schema request, through
              the OpenAI SDK when installed, else plain HTTP (needs Ray: carry the full bundle).
Each phase saves the result file as it finishes; a phase that raises is recorded under the
model's `errors` and the next one runs. The top-level ours_tok_s / transformers_tok_s /
ratio_vs_transformers / roofline_fraction are the Llama-3-8B-shaped model's when it ran, else
SmolLM2's; targets_8b holds issue 39's targets (>= 4x transformers, roofline >= 0.6, batch-1
step <= 1.25x ideal, prefill >= 50% of the GEMM rate).
Exit status: 0 when every check that ran passed (parity, graphs, serve), 1 if one failed,
2 without a CUDA device. Checks 1-3 need no Ray.

Runbook for a session with a GPU machine (see ../shared/gpu/README.md; a call is at most 10
minutes and the session has 15 minutes of device time, machine start included):
  1. Here: `bash ../shared/gpu/bundle.sh`, then make the device calls it prints, back to back
     (each carries [".gpu/<i>"]); the last one installs the wheels and writes /tmp/gpu/env.sh.
  2. Commit first, then on the same warm machine, with SHA = `git rev-parse HEAD` written out:
       . /tmp/gpu/env.sh && python benchmarks/gpu_check.py --checks parity,serve --commit SHA \
           --out-dir /tmp/gpu/results; cp /tmp/gpu/results/*.json $OUT/
       . /tmp/gpu/env.sh && python benchmarks/gpu_check.py --checks throughput,roofline \
           --models smollm2 --commit SHA --out-dir /tmp/gpu/results; cp /tmp/gpu/results/*.json $OUT/
       . /tmp/gpu/env.sh && python benchmarks/gpu_check.py --checks throughput,roofline \
           --models llama3-8b --commit SHA --out-dir /tmp/gpu/results; cp /tmp/gpu/results/*.json $OUT/
     (--quick: a 32-sequence workload to smoke-test everything in about a minute.)
     transformers on the 8B shape takes ~160 s a static batch of 128 on an H200, so the kit's
     call 1 (330 s) ends inside it: its full figure needs a call of its own,
     `--checks throughput --models llama3-8b --hf-batch-sizes 256` (about 5 minutes).
  3. Copy the returned JSON to benchmarks/results/ and commit it with the code it measured.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from gpu_kv_tier import check_kv_tier  # noqa: E402  benchmarks/, this script's folder
from gpu_serve import check_serve  # noqa: E402

CHECKS = ("parity", "throughput", "roofline", "serve")
MODELS = ("smollm2", "llama3-8b")
HF_BATCH_SIZES = {"smollm2": "64,128,256", "llama3-8b": "64,128"}
PARITY_PROMPTS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain recursion to a child.",
    "List three prime numbers and say why they are prime.", "Translate 'good morning' into Spanish.",
    "What does a CPU cache do?", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in two sentences.", "What is 17 times 23?"]
LLAMA3_8B_SHAPE = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)


# ---- set-up -------------------------------------------------------------------------------------
def gpu_preset(**overrides) -> dict:
    import yaml

    values = yaml.safe_load((ROOT / "configs" / "gpu.yaml").read_text())
    values.update(overrides)
    return values


def commit_of(explicit: str | None) -> str:
    if explicit:
        return explicit
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (pass --commit)"


def free_gpu() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def model_path(name: str, work: Path) -> str:
    """SmolLM2's GGUF, or a folder with a Llama-3-8B-shaped config.json and SmolLM2's tokenizer
    (the weights come from load_format=dummy)."""
    from cluster.config import resolve_model_path

    if name == "smollm2":
        return resolve_model_path("smollm2-135m-instruct")
    from transformers import LlamaConfig

    from cluster.tokenizer import Tokenizer

    folder = work / "llama3-8b-shape"
    if not (folder / "config.json").is_file():
        LlamaConfig(**LLAMA3_8B_SHAPE, architectures=["LlamaForCausalLM"]).save_pretrained(folder)
        Tokenizer.load(resolve_model_path("smollm2-135m-instruct")).hf.save_pretrained(folder)
    return str(folder)


def hf_model(name: str, path: str, dtype: torch.dtype):
    """HF's model on the GPU: SmolLM2 from the dequantized checkpoint our loader wrote (the
    same weights we serve), the 8B shape randomly initialised."""
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from cluster.model.loader import gguf_cache_dir

    # transformers 5 names it dtype; 4.x takes torch_dtype (and would keep `dtype` as a config field).
    kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": dtype}
    if name == "smollm2":
        model = AutoModelForCausalLM.from_pretrained(gguf_cache_dir(path), **kw).cuda()
    else:
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), **kw)
    if next(model.parameters()).dtype != dtype:
        raise RuntimeError(f"transformers loaded {next(model.parameters()).dtype}, not {dtype}")
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    return model.eval()


def runner_of(llm):
    return llm.engine.executor.worker.runner


# ---- 1. parity ----------------------------------------------------------------------------------------
def check_parity(args) -> dict:
    from cluster import LLM, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    path = model_path("smollm2", args.work_dir)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    runs, info = {}, {}
    for label, eager in (("graphs", False), ("eager", True)):
        llm = LLM(**gpu_preset(model=path, dtype="float32", max_num_seqs=16, max_model_len=2048,
                               gpu_memory_utilization=0.5, enforce_eager=eager))
        tok = llm.get_tokenizer()
        prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                              False) for p in PARITY_PROMPTS]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        runs[label] = [o.outputs[0].token_ids for o in outs]
        runner = runner_of(llm)
        info[label] = {"backend": runner.attention_backend, "graph_sizes": runner.graphs.sizes if runner.graphs else None,
                       "replays": runner.graphs.num_replays if runner.graphs else 0}
        del llm, runner, outs
        free_gpu()
    model = hf_model("smollm2", path, torch.float32)
    hf = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=48, do_sample=False,
                                 pad_token_id=0)
            hf.append(out[0, len(p):].tolist())
    del model
    free_gpu()
    mismatch = [{"prompt": i, "first_diff": next(j for j, (a, b) in enumerate(zip(x, y)) if a != b)}
                for i, (x, y) in enumerate(zip(runs["graphs"], hf)) if x != y]
    graphs_used = info["graphs"]["replays"] > 0 and info["eager"]["replays"] == 0
    return {"attention_backend": info["graphs"]["backend"], "parity": not mismatch,
            "cuda_graphs": graphs_used and runs["graphs"] == runs["eager"],
            "parity_detail": {"prompts": len(prompts), "tokens_each": 48, "mismatches_vs_transformers": mismatch,
                              "graphs_equal_eager": runs["graphs"] == runs["eager"], **info}}


# ---- 2. throughput and 3. roofline ------------------------------------------------------------------
def workload(n: int, lo: int, hi: int, seed: int = 0):
    rng = random.Random(seed)  # nano-vLLM's bench: token ids below 10000, lengths uniform
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def run_ours(llm, prompts, out_lens) -> dict:
    from cluster import SamplingParams

    params = [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True) for m in out_lens]
    llm.generate([{"prompt_token_ids": prompts[0][:32]}], SamplingParams(max_tokens=8), use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return {"tok_s": produced / elapsed, "seconds": elapsed, "output_tokens": produced,
            "preemptions": llm.engine.stats().preemptions}


def run_hf(model, prompts, out_lens, batch_size: int, on_batch=None) -> dict:
    """transformers' static batches; `on_batch(figures so far)` after each (a partial figure
    survives a timeout)."""
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), out_lens[i]))
    torch.cuda.synchronize()
    t0, produced = time.perf_counter(), 0
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s: s + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros(len(idx), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):  # left padding, as HF expects for generation
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            model.generate(ids.cuda(), attention_mask=mask.cuda(), max_new_tokens=max(out_lens[i] for i in idx),
                           do_sample=True, temperature=0.6, top_k=0, top_p=1.0, pad_token_id=0)
            produced += sum(out_lens[i] for i in idx)  # only the tokens each request asked for
            if on_batch is not None:
                torch.cuda.synchronize()
                on_batch({"batch_size": batch_size, "partial": f"{s + len(idx)}/{len(order)} requests",
                          "output_tokens": produced, "seconds": time.perf_counter() - t0,
                          "tok_s": produced / (time.perf_counter() - t0)})
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return {"batch_size": batch_size, "tok_s": produced / elapsed, "seconds": elapsed}


def measure_bandwidth(nbytes: int = 1 << 30, reps: int = 20) -> float:
    """Device-to-device copy: bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    rate = 2 * nbytes * reps / (start.elapsed_time(end) / 1000)
    del src, dst
    free_gpu()
    return rate


def start_decode(core, num_seqs: int, context: int, steps: int, tag: str):
    """Add `num_seqs` requests of `context` random tokens and prefill them all: returns the step
    function (which counts each request's tokens), the counts, and the request ids."""
    from cluster.messages import EngineRequest
    from cluster.sampling_params import SamplingParams

    rng = random.Random(1)
    # Long enough that no request finishes in the window, however early its prefill ran.
    params = SamplingParams(temperature=0.0, max_tokens=steps + context, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(num_seqs)]
    for rid in ids:
        core.add_request(EngineRequest(rid, [rng.randint(0, 10000) for _ in range(context)], params))
    produced = dict.fromkeys(ids, 0)

    def step() -> None:
        for o in core.step():
            produced[o.request_id] += len(o.new_token_ids)

    while not all(produced.values()):  # prefill everything (each request's first token)
        step()
    step()
    return step, produced, ids


def end_decode(core, ids: list[str]) -> None:
    for rid in ids:
        core.abort(rid)
    while core.has_unfinished():
        core.step()


def decode_roofline(llm, num_seqs: int, context: int, steps: int, bandwidth: float) -> dict:
    """Time pure-decode engine steps with `num_seqs` sequences near `context` tokens each,
    against the bytes such a step must move at the measured bandwidth."""
    from cluster.model.kv_cache import kv_cache_bytes_per_block

    core, runner = llm.engine, runner_of(llm)
    step, produced, ids = start_decode(core, num_seqs, context, steps, "roofline")
    before = sum(produced.values())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    step_s = (time.perf_counter() - t0) / steps
    if sum(produced.values()) - before != steps * num_seqs:
        raise RuntimeError("the roofline window was not pure decode of every sequence")
    end_decode(core, ids)
    mc = llm.config.model_config
    embed = runner.model.model.embed_tokens.weight
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    if not runner.model.tied:  # an untied embedding is looked up by row, not streamed
        weights -= embed.numel() * embed.element_size()
    per_token = kv_cache_bytes_per_block(mc.hf_config, runner.parallel, 1, llm.config.cache_config.kv_torch_dtype)
    avg_context = context + before / num_seqs + (steps - 1) / 2  # mean over the window's steps
    kv = int(num_seqs * avg_context * per_token)
    ideal_s = (weights + kv) / bandwidth
    return {"num_seqs": num_seqs, "avg_context": avg_context, "step_ms": step_s * 1e3,
            "ideal_step_ms": ideal_s * 1e3, "weight_bytes": weights, "kv_bytes_read": kv,
            "roofline_fraction": ideal_s / step_s, "decode_tok_s": num_seqs / step_s,
            "graphs_used": runner.graphs is not None and runner.graphs.num_replays > 0}


KERNEL_KINDS = (("attention", ("paged", "attn", "attention", "flash", "sdpa")),
                ("gemm", ("gemm", "gemv", "nvjet", "cutlass", "sm90_xmma", "matmul", "splitk")))


def profile_decode(llm, num_seqs: int, context: int, steps: int) -> dict:
    """Pure-decode steps as in decode_roofline, under torch.profiler: device time a step by
    kernel against the step's wall time. `gpu_busy_ms` is the sum of kernel times (kernels of a
    CUDA graph replay included where CUPTI reports them); `host_gap_ms` is the wall time the GPU
    is not computing: the engine's scheduling, input preparation, sampling's host side."""
    from torch.profiler import ProfilerActivity, profile

    core = llm.engine
    step, _, ids = start_decode(core, num_seqs, context, steps + 2, "profile")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / steps
    end_decode(core, ids)
    kernels: dict[str, float] = {}
    for evt in prof.key_averages():
        if str(getattr(evt, "device_type", "")).endswith("CUDA"):
            us = getattr(evt, "self_device_time_total", None) or getattr(evt, "self_cuda_time_total", 0)
            kernels[evt.key] = kernels.get(evt.key, 0.0) + us / 1e3 / steps
    busy = sum(kernels.values())
    kinds = dict.fromkeys([k for k, _ in KERNEL_KINDS] + ["other"], 0.0)
    for name, ms in kernels.items():
        kind = next((k for k, words in KERNEL_KINDS if any(w in name.lower() for w in words)), "other")
        kinds[kind] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:15]
    return {"num_seqs": num_seqs, "steps": steps, "wall_step_ms": wall * 1e3, "gpu_busy_ms": busy,
            "host_gap_ms": wall * 1e3 - busy, "by_kind_ms": kinds, "kernels": len(kernels),
            "top_kernels_ms": [[name[:120], ms] for name, ms in top]}


def measure_gemm_tflops(n: int = 8192, reps: int = 20) -> float:
    """The chip's bf16 GEMM rate as torch reaches it: an n x n x n matmul, timed on the device."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        a @ b
    end.record()
    end.synchronize()
    del a, b
    free_gpu()
    return 2 * n ** 3 * reps / (start.elapsed_time(end) / 1000) / 1e12


def prefill_rate(llm, num_seqs: int, length: int, gemm_tflops: float) -> dict:
    """Prefill `num_seqs` prompts of `length` random tokens (one output token each): the model's
    FLOPs (2 per weight per token, plus causal attention) over the time, against the GEMM rate."""
    from cluster import SamplingParams

    rng, runner, hf = random.Random(2), runner_of(llm), llm.config.model_config.hf_config
    prompts = [[rng.randint(0, 10000) for _ in range(length)] for _ in range(num_seqs)]
    embed = runner.model.model.embed_tokens.weight.numel()
    matmul_params = sum(p.numel() for p in runner.model.parameters()) - (0 if runner.model.tied else embed)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    attn = 2 * hf.num_hidden_layers * hf.num_attention_heads * head_dim * length * length  # QK^T + PV, causal
    flops = num_seqs * (2 * matmul_params * length + attn)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p[:64]} for p in prompts[:2]], params, use_tqdm=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"num_seqs": num_seqs, "length": length, "seconds": seconds, "tok_s": num_seqs * length / seconds,
            "tflops": flops / seconds / 1e12, "gemm_tflops": gemm_tflops,
            "fraction_of_gemm": flops / seconds / 1e12 / gemm_tflops}


def phase(fig: dict, key: str, save, fn) -> None:
    """Run one measurement into fig[key], saving the result file after it; an exception is
    recorded under fig['errors'] and the next phase runs (a late failure loses nothing)."""
    try:
        fig[key] = fn()
    except Exception as exc:  # recorded in the JSON, with the traceback's tail
        import traceback

        fig.setdefault("errors", {})[key] = {"error": repr(exc)[:1000], "traceback": traceback.format_exc()[-3000:]}
        print(f"[{fig['model']}] {key} FAILED: {exc!r}", flush=True)
        free_gpu()
    save()


def check_model(args, name: str, checks: set[str], bandwidth: float | None, fig: dict, save) -> None:
    """Fill `fig` phase by phase (load, throughput, batch-1 and 256-sequence decode roofline,
    prefill, transformers (each batch size), ours with async scheduling: throughput and the two
    decode rooflines again), calling `save` after each."""
    from cluster import LLM

    path = model_path(name, args.work_dir)
    n, lo, hi = (32, 32, 128) if args.quick else (args.num_seqs, 100, 1024)
    prompts, out_lens = workload(n, lo, hi)
    extra = {"load_format": "dummy"} if name == "llama3-8b" else {}
    fig.update(model=name, dtype="bfloat16", workload={"num_seqs": n, "lengths": [lo, hi], "output_tokens": sum(out_lens)})
    t0 = time.perf_counter()
    llm = LLM(**gpu_preset(model=path, dtype="bfloat16", **extra))
    runner = runner_of(llm)
    fig.update(attention_backend=runner.attention_backend, cuda_graphs=runner.graphs is not None,
               num_kv_blocks=runner.num_blocks, startup_s=time.perf_counter() - t0)
    del runner
    save()
    if "throughput" in checks:
        phase(fig, "ours", save, lambda: run_ours(llm, prompts, out_lens))
        if "ours" in fig:
            print(f"[{name}] llm-cluster {fig['ours']['tok_s']:.0f} tok/s", flush=True)
    if "roofline" in checks:
        context, steps = (64, 8) if args.quick else (args.roofline_context, 32)
        phase(fig, "batch1", save, lambda: decode_roofline(llm, 1, context, steps, bandwidth))
        phase(fig, "roofline", save, lambda: decode_roofline(llm, min(n, args.num_seqs), context, steps, bandwidth))
        for key in ("batch1", "roofline"):
            if key in fig:
                print(f"[{name}] {key}: decode step {fig[key]['step_ms']:.2f} ms, ideal "
                      f"{fig[key]['ideal_step_ms']:.2f} ms: {fig[key]['roofline_fraction']:.1%}", flush=True)
        # The same decode steps under the profiler: where the step's time goes.
        phase(fig, "profile_batch1", save, lambda: profile_decode(llm, 1, context, 8))
        phase(fig, "profile_256", save, lambda: profile_decode(llm, min(n, args.num_seqs), context, 8))
        for key in ("profile_batch1", "profile_256"):
            if key in fig:
                p = fig[key]
                print(f"[{name}] {key}: wall {p['wall_step_ms']:.2f} ms, GPU busy {p['gpu_busy_ms']:.2f} ms "
                      f"{ {k: round(v, 2) for k, v in p['by_kind_ms'].items()} }", flush=True)
        phase(fig, "prefill", save, lambda: prefill_rate(llm, 2 if args.quick else 8, 256 if args.quick else 2048,
                                                         measure_gemm_tflops(2048 if args.quick else 8192)))
        if "prefill" in fig:
            print(f"[{name}] prefill {fig['prefill']['tflops']:.0f} TFLOP/s of a {fig['prefill']['gemm_tflops']:.0f} "
                  f"TFLOP/s GEMM ({fig['prefill']['fraction_of_gemm']:.1%})", flush=True)
    del llm
    free_gpu()
    if "throughput" not in checks:
        return

    model = hf_model(name, path, torch.bfloat16)
    fig["transformers"] = []
    for bs in [int(b) for b in (args.hf_batch_sizes or HF_BATCH_SIZES[name]).split(",")]:
        try:
            fig["transformers"].append(run_hf(model, prompts, out_lens, bs, on_batch=lambda part: (
                fig.update(transformers_partial=part), save())))
            fig.pop("transformers_partial", None)
        except torch.cuda.OutOfMemoryError:
            fig["transformers"].append({"batch_size": bs, "error": "CUDA out of memory"})
            free_gpu()
        print(f"[{name}] transformers {fig['transformers'][-1]}", flush=True)
        save()
    del model
    free_gpu()
    best = max((r for r in fig["transformers"] if "tok_s" in r), key=lambda r: r["tok_s"], default=None)
    if best is not None:
        fig["transformers_best"] = best
        if "ours" in fig:
            fig["ratio_vs_transformers"] = fig["ours"]["tok_s"] / best["tok_s"]
    save()

    # Async scheduling (the worker runs step N+1 while the engine applies step N): the same
    # throughput workload, and the decode steps again, to see how much host time it hides.
    llm = LLM(**gpu_preset(model=path, dtype="bfloat16", async_scheduling=True, **extra))
    phase(fig, "ours_async", save, lambda: run_ours(llm, prompts, out_lens))
    if "ours_async" in fig and "ours" in fig:
        fig["async_vs_plain"] = fig["ours_async"]["tok_s"] / fig["ours"]["tok_s"]
        print(f"[{name}] llm-cluster, async scheduling {fig['ours_async']['tok_s']:.0f} tok/s "
              f"({fig['async_vs_plain']:.3f}x)", flush=True)
    if "roofline" in checks:
        context, steps = (64, 8) if args.quick else (args.roofline_context, 32)
        phase(fig, "batch1_async", save, lambda: decode_roofline(llm, 1, context, steps, bandwidth))
        phase(fig, "roofline_async", save,
              lambda: decode_roofline(llm, min(n, args.num_seqs), context, steps, bandwidth))
        for key in ("batch1_async", "roofline_async"):
            if key in fig:
                print(f"[{name}] {key}: decode step {fig[key]['step_ms']:.2f} ms, ideal "
                      f"{fig[key]['ideal_step_ms']:.2f} ms: {fig[key]['roofline_fraction']:.1%}", flush=True)
    del llm
    free_gpu()

# ---- 4. the result file -------------------------------------------------------------------------------
def headline(result: dict) -> None:
    models = result.get("models", {})
    name = "llama3-8b" if "ratio_vs_transformers" in models.get("llama3-8b", {}) else "smollm2"
    fig = models.get(name, {})
    if "ours" in fig:
        result.update(headline_model=name, ours_tok_s=fig["ours"]["tok_s"],
                      transformers_tok_s=fig.get("transformers_best", {}).get("tok_s"),
                      ratio_vs_transformers=fig.get("ratio_vs_transformers"))
    roof = models.get("llama3-8b", {}).get("roofline") or models.get("smollm2", {}).get("roofline")
    if roof:
        result["roofline_fraction"] = roof["roofline_fraction"]
    big = models.get("llama3-8b", {})
    if big:
        roof_8b = big.get("roofline", {}).get("roofline_fraction") or 0
        b1 = big.get("batch1", {})
        result["targets_8b"] = {"ratio_vs_transformers>=4": (big.get("ratio_vs_transformers") or 0) >= 4,
                                "roofline_fraction>=0.6": roof_8b >= 0.6,
                                "batch1_step<=1.25x_ideal": bool(b1) and b1["step_ms"] <= 1.25 * b1["ideal_step_ms"],
                                "prefill>=0.5_gemm": big.get("prefill", {}).get("fraction_of_gemm", 0) >= 0.5}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checks", default=",".join(CHECKS))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "llm-cluster-gpu-check")
    ap.add_argument("--commit", help="the commit measured (the device copy may have no .git)")
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--hf-batch-sizes", help="e.g. 64,128 (default per model: %s)" % HF_BATCH_SIZES)
    ap.add_argument("--roofline-context", type=int, default=512)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--serve-timeout", type=float, default=420.0)
    ap.add_argument("--quick", action="store_true", help="a small workload: a smoke test of every step")
    args = ap.parse_args()
    checks = set(args.checks.split(","))
    if not checks <= set(CHECKS) or not set(args.models.split(",")) <= set(MODELS):
        ap.error(f"--checks takes {CHECKS}, --models {MODELS}")
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False): nothing measured, "
              "no result written. Run it on a GPU machine (see this script's docstring).", file=sys.stderr)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    out = args.out_dir / f"gpu-{re.sub(r'[^a-z0-9]+', '-', device.lower()).strip('-')}.json"
    result = json.loads(out.read_text()) if out.is_file() else {}

    def save(**updates) -> None:
        result.update(updates, device=device, torch=torch.__version__, commit=commit_of(args.commit),
                      cuda=torch.version.cuda, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z"))
        headline(result)
        out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        print(f"wrote {out}", flush=True)

    failed = []
    if "parity" in checks:
        save(**check_parity(args))
        failed += [k for k in ("parity", "cuda_graphs") if not result[k]]
    if checks & {"throughput", "roofline"}:
        bandwidth = measure_bandwidth()
        save(bandwidth_gb_s=bandwidth / 1e9)
        for name in args.models.split(","):
            fig = result.setdefault("models", {})[name] = {}
            try:
                check_model(args, name, checks, bandwidth, fig, save)
            except Exception as exc:  # a load or transformers failure: what was measured stays saved
                import traceback

                fig.setdefault("errors", {})["check_model"] = {"error": repr(exc)[:1000],
                                                               "traceback": traceback.format_exc()[-3000:]}
                print(f"[{name}] FAILED: {exc!r}", flush=True)
                free_gpu()
            save()
    if "parity" in checks:
        try:
            save(**check_kv_tier(gpu_preset(model=model_path("smollm2", args.work_dir)), args.work_dir / "kv-tier"))
        except Exception as exc:  # recorded; the serve check still runs
            import traceback

            save(kv_tier_ok=False, kv_tier={"error": repr(exc)[:1000], "traceback": traceback.format_exc()[-3000:]})
        failed += [] if result["kv_tier_ok"] else ["kv_tier_ok"]
    if "serve" in checks:
        save(**check_serve(args.port, args.serve_timeout))
        failed += [] if result["serve_ok"] else ["serve_ok"]
    print(json.dumps({k: result.get(k) for k in ("device", "attention_backend", "parity", "cuda_graphs", "kv_tier_ok",
                                                 "serve_ok",
                                                 "ours_tok_s", "transformers_tok_s", "ratio_vs_transformers",
                                                 "roofline_fraction")}, indent=2))
    if failed:
        print(f"gpu_check: FAILED {failed}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
