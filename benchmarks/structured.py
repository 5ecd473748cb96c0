"""Structured-output overhead: decode throughput at batch 32 with every row JSON-schema
constrained vs the same batch unconstrained, in one run (SmolLM2, bf16 by default).

The schema asks for a long array of small objects so constrained rows decode as long as the
unconstrained ones; both count only the tokens actually produced.

    .venv/bin/python benchmarks/structured.py [--batch 32] [--max-tokens 128]
"""
from __future__ import annotations

import argparse
import time

import torch

from cluster import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {"type": "array", "minItems": 40, "items": {
    "type": "object", "required": ["id", "ok", "tag"], "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
        "tag": {"type": "string", "enum": ["alpha", "beta", "gamma"]}}}}


def timed(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.batch, max_model_len=1024)
    prompts = [f"<|im_start|>user\nList {40 + i} records as JSON.<|im_end|>\n<|im_start|>assistant\n"
               for i in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    timed(llm, prompts, schema)  # compile and warm up (buffers, caches), outside the timings
    timed(llm, prompts, plain)
    runs_u, runs_c = [], []
    for _ in range(args.repeats):  # alternate so drift in machine load hits both alike
        runs_u.append(timed(llm, prompts, plain))
        runs_c.append(timed(llm, prompts, schema))
    el_u, tok_u = min(runs_u)
    el_c, tok_c = min(runs_c)
    u, c = tok_u / el_u, tok_c / el_c
    print(f"batch {args.batch}, {args.dtype}, {args.threads} threads")
    print(f"unconstrained:     {u:8.1f} output tok/s ({tok_u} tokens, {el_u:.1f} s)")
    print(f"json-constrained:  {c:8.1f} output tok/s ({tok_c} tokens, {el_c:.1f} s)")
    print(f"ratio constrained / unconstrained: {c / u:.1%}  (target >= 85%)")


if __name__ == "__main__":
    main()
