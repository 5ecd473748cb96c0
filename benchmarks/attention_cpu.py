"""Attention micro-benchmark on CPU: the "cpu_paged" kernel vs the "torch" backend, same op.

SmolLM2-135M's attention shapes (9 query heads, 3 KV heads, head dim 64), bf16 cache in blocks
of 16 handed out in random order, --layers layers each with its own cache (so a step streams
the KV from memory as the engine's does). For each case it times one "step" (every layer once,
metadata built once, as the runner does) per backend, alternating the backends --repeats times,
and prints the median and the spread (min-max over the median) of each, then their ratio.

Cases: decode batches (N sequences, context lengths uniform in [L/2, L]) and prefill chunks over
a cached prefix (P cached tokens + Q new ones, one sequence), and prefills with no prefix. In
bf16 on a CPU with AVX512-BF16, "cpu_paged" runs chunks of more than 64 queries through the
kernel library's prefill_attention, "torch" through SDPA.

    .venv/bin/python benchmarks/attention_cpu.py [--layers 8] [--repeats 5] [--quick]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from cluster.model.context import build_attention_metadata, set_forward_context
from cluster.model.layers.attention import Attention, make_backend

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def make_layers(n: int, num_blocks: int, backend: str, dtype: torch.dtype) -> list[Attention]:
    impl = make_backend(backend)
    layers = []
    for _ in range(n):
        layer = Attention(HEADS, HEAD_DIM, HEAD_DIM ** -0.5, KV_HEADS)
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        layer.k_cache = torch.randn(shape).to(dtype)
        layer.v_cache = torch.randn(shape).to(dtype)
        layer.backend_name, layer.backend = backend, impl
        layers.append(layer)
    return layers


def make_seqs(specs: list[tuple[int, int]], num_blocks: int, seed: int):
    """(query_len, context_len) per sequence -> (query_len, context_len, block_ids)."""
    free = list(range(num_blocks))
    random.Random(seed).shuffle(free)
    seqs = []
    for q, c in specs:
        seqs.append((q, c, [free.pop() for _ in range(-(-c // BLOCK))]))
    return seqs


def step(layers, seqs, backend: str, qkv) -> float:
    q, k, v = qkv
    t0 = time.perf_counter()
    meta = build_attention_metadata(seqs, BLOCK, "cpu", backend)
    with torch.inference_mode(), set_forward_context(meta):
        for layer in layers:
            layer(q, k, v)
    return time.perf_counter() - t0


def run_case(name: str, specs, args, dtype) -> None:
    tokens = sum(q for q, _ in specs)
    num_blocks = sum(-(-c // BLOCK) for _, c in specs) + 8
    seqs = make_seqs(specs, num_blocks, args.seed)
    qkv = (torch.randn(tokens, HEADS * HEAD_DIM).to(dtype), torch.randn(tokens, KV_HEADS * HEAD_DIM).to(dtype),
           torch.randn(tokens, KV_HEADS * HEAD_DIM).to(dtype))
    backends = ("torch", "cpu_paged")
    layers = {b: make_layers(args.layers, num_blocks, b, dtype) for b in backends}
    for b in backends:  # warm-up: workspaces, first-touch of the caches
        step(layers[b], seqs, b, qkv)
    times: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(args.repeats):
        for b in backends:
            times[b].append(step(layers[b], seqs, b, qkv))
    med = {b: statistics.median(t) for b, t in times.items()}
    spread = {b: (max(t) - min(t)) / med[b] for b, t in times.items()}
    print(f"{name:<34} torch {med['torch'] * 1e3:8.2f} ms (±{spread['torch']:.0%})   "
          f"cpu_paged {med['cpu_paged'] * 1e3:8.2f} ms (±{spread['cpu_paged']:.0%})   "
          f"speed-up {med['torch'] / med['cpu_paged']:5.2f}x", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="two small cases, 2 layers, 2 repeats")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    rng = random.Random(args.seed)
    decode = [(1, 128), (1, 512), (1, 1024)] if not args.quick else [(1, 64)]
    batches = [16, 64, 128] if not args.quick else [8]
    prefill = [(256, 16), (256, 64), (512, 256), (64, 512), (1024, 128)] if not args.quick else [(64, 16)]
    if args.quick:
        args.layers, args.repeats = 2, 2
    print(f"{args.layers} layers, {args.repeats} alternating repeats, {args.threads} threads, {args.dtype}")
    for n in batches:
        for _, length in decode:
            specs = [(1, rng.randint(length // 2, length)) for _ in range(n)]
            run_case(f"decode n={n} ctx<={length}", specs, args, dtype)
    for prefix, q in prefill:
        run_case(f"prefill prefix={prefix} chunk={q}", [(q, prefix + q)], args, dtype)
    for q in ([256, 512, 1024] if not args.quick else [64]):
        run_case(f"prefill no prefix chunk={q}", [(q, q)], args, dtype)


if __name__ == "__main__":
    main()
