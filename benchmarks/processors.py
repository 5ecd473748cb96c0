"""Decode-step sampling cost: built-in logits processors active on every row vs none.

Batch 64, vocab 49152 (SmolLM2), bf16 and fp32 logits. Each timed step is what rank 0 does
per decode step after the model: `InputBatch.refresh()` (BatchUpdate, processor
update_state, metadata) plus the `Sampler` (processors, temperature, random sampling).
Configurations:
  none      default params on every row (temperature 1, random sampling, no processor work)
  builtins  every row: min_p, logit_bias (8 tokens), min_tokens with stop ids (all active)
  greedy-*  the same with temperature 0 (greedy rows skip the argmax-invariant min-p)
  all       builtins + penalties + top-k + top-p + logprobs=5 on every row (for scale)
The model step itself is measured elsewhere (benchmarks/throughput.py); pass --step-ms to
express the processors' extra time as a share of a whole decode step.

    .venv/bin/python benchmarks/processors.py [--batch 64] [--step-ms 120] [--threads 2]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from cluster.config import EngineConfig
from cluster.sample import Sampler
from cluster.sample.logits_processor import build_logitsprocs
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import CachedRequestState, InputBatch

EOS = 2


def make_params(kind: str, vocab: int, rng: random.Random) -> SamplingParams:
    temp = 0.0 if kind.startswith("greedy") else 0.8
    if kind in ("none", "greedy-none"):
        return SamplingParams(temperature=temp)
    kw = dict(temperature=temp, min_p=0.05, min_tokens=10_000, max_tokens=None,
              stop_token_ids=[rng.randrange(vocab) for _ in range(2)],
              logit_bias={rng.randrange(vocab): rng.uniform(-3, 3) for _ in range(8)})
    if kind == "all":
        kw.update(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                  top_k=50, top_p=0.9, logprobs=5)
    return SamplingParams(**kw)


def time_config(kind: str, batch: int, vocab: int, dtype: torch.dtype, iters: int, clock) -> float:
    rng = random.Random(0)
    cfg = EngineConfig.create(max_num_seqs=batch).with_facts(eos_token_id=EOS)
    ib = InputBatch(batch, vocab, "cpu", build_logitsprocs(cfg, "cpu", False))
    states = []
    for i in range(batch):
        prompt = [rng.randrange(vocab) for _ in range(64)]
        s = CachedRequestState(f"r{i}", prompt, make_params(kind, vocab, rng), [], [], 0, None)
        ib.add_request(s)
        states.append(s)
    sampler = Sampler()
    logits = (torch.randn(batch, vocab) * 4).to(dtype)
    times = []
    for step in range(iters + 3):
        work = logits.clone()
        t0 = clock()
        out = sampler(work, ib.refresh())
        tokens = out.sampled_token_ids.tolist()
        dt = clock() - t0
        for s, t in zip(states, tokens):
            s.output_token_ids.append(t)
        if step >= 3:
            times.append(dt * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                    help="cpu: process CPU time, steadier on a busy machine (use with --threads 1)")
    ap.add_argument("--step-ms", type=float, default=None,
                    help="model forward time of one decode step at this batch (measured elsewhere)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"batch {args.batch}, vocab {args.vocab}, {args.threads} threads, {args.clock} clock, "
          f"median of {args.iters} steps")
    for name in args.dtypes.split(","):
        res = {k: time_config(k, args.batch, args.vocab, dtypes[name], args.iters, clock)
               for k in ("none", "builtins", "greedy-none", "greedy-builtins", "all")}
        print(f"[{name} logits] sampling step (refresh + sampler), ms:")
        for k, v in res.items():
            print(f"  {k:16s} {v:8.2f}")
        for base, full in (("none", "builtins"), ("greedy-none", "greedy-builtins")):
            extra = res[full] - res[base]
            line = f"  {full} vs {base}: +{extra:.2f} ms, ratio {res[full] / res[base]:.2f}x"
            if args.step_ms:
                step = args.step_ms + res[base]
                line += f", {100 * extra / step:.1f}% of a {step:.1f} ms decode step"
            print(line)
    if not args.step_ms:
        print("(pass --step-ms <model forward ms> to express the extra as a share of a decode step)")


if __name__ == "__main__":
    main()
