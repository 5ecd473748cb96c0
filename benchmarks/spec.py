"""N-gram speculative decoding: output tokens/s with and without it, same run, same requests.

Workloads: copy-heavy chat requests (repeat a passage, edit a passage, add a line to every
function of a code block) and free-form ones (stories, explanations), each at batch 1 (one
request at a time) and batch 16. Greedy, so both engines produce the same tokens (checked).
Runs alternate plain / speculative so drift in machine load hits both alike; the best of
`--repeats` counts. Prints tok/s, the speedup and the mean acceptance length (tokens per
verified draft). Targets: copy-heavy at batch 1 >= 2x; free-form and full batches >= 0.95x.

`--sweep` drafts at every batch size whatever the acceptance (min_acceptance_rate 0), over
batch sizes 1-32: where the speedup falls below 1 for each workload. `--calibrate` fits the
step cost model behind the drafting rule (cluster/spec/drafter.py, docs/speculative_decoding.md).

    .venv/bin/python benchmarks/spec.py [--max-tokens 128] [--repeats 2] [--sweep | --calibrate]
                                        [--model X.gguf --quantization gguf --dtype auto]
    .venv/bin/python benchmarks/spec.py --tiny     # a smoke run: seconds, numbers meaningless
"""
from __future__ import annotations

import argparse
import time

import torch

from cluster import LLM, SamplingParams

PASSAGES = [
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a brass "
    "lantern and a notebook in which he recorded the ships that passed the rocky point. Over forty "
    "years he filled twenty-three notebooks, and the harbour office still keeps them in a cabinet.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts, water is split, "
    "oxygen is released, and the energy captured from sunlight is stored in sugar molecules that the "
    "plant uses to grow, to repair its tissues and to build the seeds of the next generation.",
    "Our quarterly meeting is moved to Thursday at ten in room 4B. Please bring the updated budget, the "
    "hiring plan for the support team and your notes on the customer survey. Lunch will be provided "
    "after the meeting, and the afternoon is reserved for the planning workshop.",
    "To reset the router, unplug it for thirty seconds, plug it back in and wait until the status light "
    "turns green. If the light stays orange, hold the reset button for ten seconds, then sign in at the "
    "default address and restore the configuration file you saved during the installation.",
]
CODE = '''def load(path):
    with open(path) as f:
        return f.read()


def save(path, text):
    with open(path, "w") as f:
        f.write(text)


def append(path, text):
    with open(path, "a") as f:
        f.write(text)
'''
FREE = ["Write a short story about a dragon who learns to bake bread.",
        "Explain how a bicycle stays upright while moving.",
        "Describe your ideal weekend in a mountain village.",
        "What are the pros and cons of working from home?",
        "Invent a new board game and explain its rules.",
        "Write a letter to a friend about a trip to the sea.",
        "Explain why the sky is blue to a ten year old.",
        "Give advice to someone learning to play the guitar."]


def copy_heavy(i: int) -> str:
    passage = PASSAGES[i % len(PASSAGES)]
    kind = i % 3
    if kind == 0:
        return f"Repeat the following text exactly, word for word:\n\n{passage}"
    if kind == 1:
        return f"Rewrite the following text, changing only the first sentence to past tense:\n\n{passage}"
    return f"Add a one-line docstring to every function of this code and return the whole code:\n\n{CODE}"


def chat(llm: LLM, text: str) -> dict:
    tok = llm.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return {"prompt_token_ids": tok.encode(prompt, False)}


def timed(llm: LLM, prompts: list[dict], params: SamplingParams, batch: int):
    """(seconds, tokens, token ids per request): `batch` requests at a time."""
    out_ids = []
    t0 = time.perf_counter()
    for s in range(0, len(prompts), batch):
        outs = llm.generate(prompts[s: s + batch], params, use_tqdm=False)
        out_ids += [o.outputs[0].token_ids for o in outs]
    return time.perf_counter() - t0, sum(map(len, out_ids)), out_ids


def spec_counters(llm: LLM) -> tuple[int, int]:
    st = llm.engine.stats()
    return st.spec_decode_num_drafts, st.spec_decode_num_accepted_tokens


def compare(plain: LLM, spec: LLM, prompts: list[dict], params: SamplingParams, batch: int,
            repeats: int) -> tuple[float, float, float]:
    """(plain tok/s, spec tok/s, mean acceptance length) over the best of `repeats` each."""
    best_p = best_s = 0.0
    drafts0, acc0 = spec_counters(spec)
    for _ in range(repeats):
        el, n, want = timed(plain, prompts, params, batch)
        best_p = max(best_p, n / el)
        el, n, got = timed(spec, prompts, params, batch)
        best_s = max(best_s, n / el)
        mismatch = sum(a != b for a, b in zip(got, want))
        if mismatch:  # greedy fp32 is token-identical; bf16 numerics may flip rare near-ties
            print(f"    note: {mismatch}/{len(got)} outputs differ from the plain engine's")
    drafts, acc = spec_counters(spec)
    length = 1 + (acc - acc0) / (drafts - drafts0) if drafts > drafts0 else 1.0
    return best_p, best_s, length


def record_steps(llm: LLM, steps: list[tuple[int, int, float]]) -> None:
    """Time every decode-only step on the executor: (decoding requests, draft tokens, s)."""
    from cluster.messages import StepPlan, decode

    executor = llm.engine.executor
    submit = executor.submit  # runs the step before it returns (no async scheduling here)

    def timed_submit(plan_bytes: bytes):
        plan = decode(plan_bytes, StepPlan)
        t0 = time.perf_counter()
        out = submit(plan_bytes)
        elapsed = time.perf_counter() - t0
        drafts = sum(map(len, plan.draft_token_ids.values()))
        if plan.num_scheduled_tokens and sum(plan.num_scheduled_tokens.values()) == \
                len(plan.num_scheduled_tokens) + drafts and len(plan.sample_ids) == len(plan.num_scheduled_tokens):
            steps.append((len(plan.num_scheduled_tokens), drafts, elapsed))
        return out

    executor.submit = timed_submit


def calibrate(plain: LLM, spec: LLM, workloads: dict, params: SamplingParams) -> None:
    """Fit step time = t0 + t_dec * decoding requests + t_draft * draft tokens over the
    decode-only steps of both engines at several batch sizes; print the acceptance rate a
    request needs for its drafts to pay in a step of B decoding requests:
    theta(B) = t_draft * B / (t0 + t_dec * B) (docs/speculative_decoding.md)."""
    steps: list[tuple[int, int, float]] = []
    record_steps(plain, steps)
    record_steps(spec, steps)
    for batch in (1, 2, 4, 8, 16, 32):
        for prompts in workloads.values():
            prompts = (prompts * (batch // len(prompts) + 1))[:max(batch, len(prompts))]
            for llm in (plain, spec):
                timed(llm, prompts, params, batch)
    x = torch.tensor([[1.0, b, d] for b, d, _ in steps], dtype=torch.float64)
    y = torch.tensor([t for _, _, t in steps], dtype=torch.float64)
    t0, t_dec, t_draft = torch.linalg.lstsq(x, y.unsqueeze(1)).solution.squeeze(1).tolist()
    resid = (x @ torch.tensor([t0, t_dec, t_draft], dtype=torch.float64) - y).abs().median().item()
    print(f"{len(steps)} decode steps: t0 {t0 * 1e3:.2f} ms + {t_dec * 1e3:.3f} ms per decoding request "
          f"+ {t_draft * 1e3:.3f} ms per draft token (median |residual| {resid * 1e3:.2f} ms)")
    print(f"DECODE_COST = t_dec / t0 = {t_dec / t0:.4f}, DRAFT_COST = t_draft / t0 = {t_draft / t0:.4f}")
    for b in (1, 2, 4, 8, 16, 32, 64):
        print(f"  B={b:3d}: drafts pay above acceptance rate {t_draft * b / (t0 + t_dec * b):.2f}")


def engines(args, spec_config: dict) -> tuple[LLM, LLM]:
    common = dict(dtype=args.dtype, max_model_len=1024, max_num_seqs=max(args.batches),
                  kv_cache_memory=256 << 20, quantization=args.quantization)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_config=spec_config, **common)
    warm = [chat(plain, copy_heavy(0)), chat(plain, FREE[0])]
    for llm in (plain, spec):  # one-time costs (kernels for new shapes) outside the timings
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    return plain, spec


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quantization", help="the engine option: int8, or gguf (a .gguf --model served in its blocks)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--requests", type=int, default=16, help="requests per workload")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--lookup", default="2,4", help="prompt_lookup_min,prompt_lookup_max")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sweep", action="store_true", help="speculate at every batch size (threshold)")
    ap.add_argument("--calibrate", action="store_true", help="fit the step cost model behind the rule")
    ap.add_argument("--tiny", action="store_true", help="smoke run: 2 requests, 8 tokens, 1 repeat")
    args = ap.parse_args()
    if args.tiny:
        args.requests, args.max_tokens, args.repeats, args.batches = 2, 8, 1, "1,2"
    args.batches = [int(b) for b in args.batches.split(",")]
    if args.sweep and not args.tiny:
        args.batches = [1, 2, 4, 8, 16, 32]
    torch.set_num_threads(args.threads)
    lo, hi = (int(x) for x in args.lookup.split(","))
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": lo,
                   "prompt_lookup_max": hi}
    if args.sweep or args.calibrate:
        spec_config |= {"min_acceptance_rate": 0.0}
        args.batches = sorted(set(args.batches) | {32})
    plain, spec = engines(args, spec_config)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = {"copy-heavy": [chat(plain, copy_heavy(i)) for i in range(args.requests)],
                 "free-form": [chat(plain, FREE[i % len(FREE)]) for i in range(args.requests)]}
    if args.calibrate:
        return calibrate(plain, spec, workloads, params)
    print(f"{args.model} {args.dtype}{f', {args.quantization}' if args.quantization else ''}, {args.threads} threads, k={args.k}, lookup {lo}-{hi}, "
          f"max_tokens {args.max_tokens}, {args.requests} requests per workload"
          + (", speculation forced on (sweep)" if args.sweep else ""))
    print(f"{'workload':12} {'batch':>5} {'plain tok/s':>12} {'spec tok/s':>11} {'speedup':>8} {'accept len':>11}")
    for name, prompts in workloads.items():
        for batch in args.batches:
            if batch > len(prompts):
                prompts = (prompts * (batch // len(prompts) + 1))[:batch]
            p, s, length = compare(plain, spec, prompts, params, batch, args.repeats)
            print(f"{name:12} {batch:5d} {p:12.1f} {s:11.1f} {s / p:7.2f}x {length:11.2f}")


if __name__ == "__main__":
    main()
