"""Offline throughput: llm-cluster vs HF transformers on the same workload, same run.

nano-vLLM's workload scaled to this CPU: N requests (default 128) with random prompt lengths
64-512 and output lengths 64-512 (fixed seed, ignore_eos), SmolLM2-135M in bf16, 2 threads.
HF transformers runs the same requests with static batches (sorted by length to help it) at
each batch size given; its best is the peer figure. Also prints the bf16 matmul roofline
measured in this run: the tokens/s the model's FLOPs would allow at that matmul rate.

    .venv/bin/python benchmarks/throughput.py [--num-requests 128] [--hf-batch-sizes 16,32,64]
"""
from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch


def workload(n: int, seed: int, vocab: int, lo: int, hi: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


def run_ours(model: str, dtype: str, prompts, out_lens, max_num_seqs: int) -> tuple[float, int]:
    from cluster import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, max_num_seqs=max_num_seqs, max_model_len=2048)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in out_lens]
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4), use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(out_lens), (produced, sum(out_lens))
    return elapsed, produced


def load_hf(model_path: str, dtype: torch.dtype):
    """HF's model on the same dequantized weights we serve. A .gguf goes through our loader's
    converted checkpoint (an HF folder): transformers would otherwise keep GGUF weights
    packed and run its quantized kernels, a different computation from ours."""
    from transformers import AutoModelForCausalLM

    from cluster.model.loader import gguf_cache_dir, load_hf_config, load_model  # noqa: F401

    folder = model_path
    if model_path.endswith(".gguf"):
        folder = str(gguf_cache_dir(model_path))
        if not (Path(folder) / "config.json").is_file():
            raise SystemExit(f"run llm-cluster on {model_path} once first; it writes {folder}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    model.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    return model.eval()


def run_hf(model, prompts, out_lens, batch_size: int, pad_id: int) -> tuple[float, int]:
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), out_lens[i]))
    t0, produced = time.perf_counter(), 0
    with torch.inference_mode():
        for s in range(0, len(order), batch_size):
            idx = order[s: s + batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):  # left padding, as HF expects for generation
                ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
                mask[row, width - len(prompts[i]):] = 1
            new = max(out_lens[i] for i in idx)
            model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=pad_id)
            produced += sum(out_lens[i] for i in idx)  # only the tokens each request asked for
    return time.perf_counter() - t0, produced


def matmul_roofline(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * size**3 * reps / (time.perf_counter() - t0)


def flops_per_token(cfg, avg_context: float) -> float:
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = 2 * (h * h * 2 + 2 * h * kv + 3 * h * cfg.intermediate_size)
    attn = 2 * 2 * avg_context * h  # QK^T and PV against the context
    return layers * (per_layer + attn) + 2 * h * cfg.vocab_size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=128)
    ap.add_argument("--min-len", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--hf-batch-sizes", default="16,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from cluster.config import resolve_dtype, resolve_model_path
    from cluster.model.loader import load_hf_config

    path = resolve_model_path(args.model)
    cfg = load_hf_config(path)
    prompts, out_lens = workload(args.num_requests, args.seed, cfg.vocab_size, args.min_len, args.max_len)
    total_out = sum(out_lens)
    print(f"workload: {len(prompts)} requests, {sum(map(len, prompts))} prompt tokens, "
          f"{total_out} output tokens, dtype {args.dtype}, {args.threads} threads")

    elapsed, produced = run_ours(args.model, args.dtype, prompts, out_lens, args.max_num_seqs)
    ours = produced / elapsed
    print(f"llm-cluster:  {ours:8.1f} output tok/s  ({elapsed:.1f} s)")

    dtype = resolve_dtype(args.dtype, "cpu")
    hf_model = load_hf(path, dtype)
    best = 0.0
    for bs in [int(x) for x in args.hf_batch_sizes.split(",")]:
        el, prod = run_hf(hf_model, prompts, out_lens, bs, cfg.eos_token_id or 0)
        print(f"transformers (static batch {bs:3d}): {prod / el:8.1f} output tok/s  ({el:.1f} s)")
        best = max(best, prod / el)
    print(f"ratio llm-cluster / transformers(best): {ours / best:.2f}x  (target >= 2x)")

    rate = matmul_roofline(dtype)
    avg_ctx = sum(len(p) + m / 2 for p, m in zip(prompts, out_lens)) / len(prompts)
    roof = rate / flops_per_token(cfg, avg_ctx)
    print(f"roofline: {dtype} matmul {rate / 1e12:.2f} TFLOP/s -> {roof:,.0f} tok/s at the model's "
          f"FLOPs per token; llm-cluster reaches {ours / roof:.1%} of it")


if __name__ == "__main__":
    main()
