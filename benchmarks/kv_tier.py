"""The KV tier (docs/kv_tier.md): multi-turn conversations whose histories outgrow the KV pool,
with the tier off and on, same run, same requests.

A conversation's next turn (its history, the last answer and a new user message) joins the back of
a queue when its answer is complete; `--concurrency` turns are in flight at a time, so every other
conversation has a turn between two of one conversation's, as users who think between turns do. The
pool holds about a quarter of the final histories (and at least what the turns in flight need), so
it has evicted a conversation's prefix before its next turn: without the tier that turn is prefilled
again; with it the prefix is read back from shared memory. Greedy with
ignore_eos, so both engines produce the same number of tokens (and, in fp32, the same tokens:
checked). Prints TTFT p50 / p90, turns/s and output tok/s for each, their ratios, the tier's
counters, and the largest size its folder reached (sampled 4 times a second) against its
budget. The tier folder is made for the run and removed after it.

`--copies 2` serves the same turns through two engines sharing one tier, as two copies of a
model on one node do, each conversation moved to the other copy at every turn (a router
spreading load, a failover): without the tier a turn never finds its history in the pool of the
copy it lands on; with it, that copy reads what the other one wrote. `--shape llama-3.2-1b`
runs a random-weight model of that shape (benchmarks/real_sizes.py's, `load_format: dummy`)
instead of SmolLM2.

    .venv/bin/python benchmarks/kv_tier.py [--conversations 16] [--turns 5] [--concurrency 4] [--out results.json]
    .venv/bin/python benchmarks/kv_tier.py --copies 2   # conversations reassigned to the other copy each turn
    .venv/bin/python benchmarks/kv_tier.py --shape llama-3.2-1b --conversations 8 --turns 4 --context 512 --message 256
    .venv/bin/python benchmarks/kv_tier.py --quick     # a smoke run: under two minutes
    .venv/bin/python benchmarks/kv_tier.py --tier-size 0.25   # a budget far under the histories: the store holds
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import threading
import time
from collections import deque
from pathlib import Path

import torch

from cluster import LLM, SamplingParams
from cluster.messages import EngineRequest


def conversations(args) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Per conversation: its opening context, and the user message of each later turn (token ids
    of ordinary vocabulary, seeded)."""
    rng = random.Random(0)

    def text(n: int) -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(n)]

    firsts = [text(args.context) for _ in range(args.conversations)]
    turns = [[text(args.message) for _ in range(args.turns - 1)] for _ in range(args.conversations)]
    return firsts, turns


def final_tokens(args) -> int:
    return args.context + (args.turns - 1) * args.message + args.turns * args.max_tokens


def run(llms: list[LLM], firsts, messages, args) -> dict:
    """Every conversation's turns, `args.concurrency` in flight, each conversation's next turn
    queued when its answer is complete: TTFT per turn, wall time, the answers. Turn t of
    conversation c goes to copy (c + t) % copies; the copies step in turn."""
    cores, params = [llm.engine for llm in llms], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    histories = [list(f) for f in firsts]
    turn = [0] * len(firsts)
    due = deque(range(len(firsts)))  # conversations whose next turn waits to be sent
    sent, ttft, answers, tokens = {}, [], {}, {}

    def send() -> None:
        while due and len(sent) - len(answers) < args.concurrency:
            c = due.popleft()
            rid = f"c{c}-t{turn[c]}"
            sent[rid] = time.perf_counter()
            core = cores[(c + turn[c]) % len(cores)]
            core.add_request(EngineRequest(rid, list(histories[c]), params, arrival_time=time.monotonic()))

    start = time.perf_counter()
    send()
    while any(core.has_unfinished() for core in cores):
        outs = [out for core in cores if core.has_unfinished() for out in core.step()]
        for out in outs:
            rid, now = out.request_id, time.perf_counter()
            if rid not in tokens:
                ttft.append(now - sent[rid])
            tokens.setdefault(rid, []).extend(out.new_token_ids)
            if not out.finished:
                continue
            c = int(rid[1:rid.index("-")])
            answers[rid] = tokens[rid]
            turn[c] += 1
            if turn[c] < args.turns:
                histories[c] += tokens[rid] + messages[c][turn[c] - 1]
                due.append(c)
            send()
    wall = time.perf_counter() - start
    ttft.sort()
    return {"wall_s": wall, "turns": len(answers), "output_tokens": sum(map(len, answers.values())),
            "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
            "turns_per_s": len(answers) / wall, "output_tok_s": sum(map(len, answers.values())) / wall,
            "answers": answers}


def engine(args, blocks: int, tier: dict) -> LLM:
    llm = LLM(args.model, dtype=args.dtype, max_model_len=final_tokens(args) + 64, num_kv_blocks=blocks,
              max_num_seqs=args.concurrency, **args.load, **tier)
    # One-time costs (kernel shapes) outside the timings.
    llm.generate({"prompt_token_ids": list(range(1000, 1000 + args.context))},
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    llm.engine.reset_stats()  # the generation counters; the tier's are the worker's since start
    return llm


STATS = ("preemptions", "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "kv_tier_hit_tokens",
         "kv_tier_load_failures", "kv_tier_bytes_read", "kv_tier_bytes_written", "kv_tier_load_seconds",
         "kv_tier_evictions", "kv_tier_blocks_written", "kv_tier_writes_held")


def random_model(shape: str, folder: str) -> str:
    """A folder with real_sizes.py's config of `shape` and SmolLM2's tokenizer (no weights:
    the engines load it with `load_format: dummy`)."""
    from real_size_files import shape_named, write_tokenizer

    out = Path(folder) / shape
    out.mkdir()
    bos, eos = write_tokenizer(out)
    (out / "config.json").write_text(json.dumps(shape_named(shape).config(bos, eos)))
    return str(out)


class FolderPeak:
    """The largest total size of the files under `folder`, sampled every `period_s` in a thread
    from start() to stop(): the tier's budget, as the run left it on disk or in shared memory."""

    def __init__(self, folder: Path, period_s: float = 0.25) -> None:
        self.folder, self.period_s, self.peak, self.samples = folder, period_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _size(self) -> int:
        total = 0
        for f in self.folder.rglob("*"):
            try:
                total += f.stat().st_size if f.is_file() else 0
            except OSError:  # evicted or renamed meanwhile
                pass
        return total

    def _watch(self) -> None:
        while not self._stop.wait(self.period_s):
            self.peak, self.samples = max(self.peak, self._size()), self.samples + 1

    def start(self) -> "FolderPeak":
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return max(self.peak, self._size())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--concurrency", type=int, default=4, help="turns in flight at a time")
    ap.add_argument("--context", type=int, default=1000, help="tokens of a conversation's opening turn")
    ap.add_argument("--message", type=int, default=400, help="tokens of each later user message")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    ap.add_argument("--pool-share", type=float, default=0.25, help="the pool, as a share of the final histories")
    ap.add_argument("--shm", default="/dev/shm", help="where the run's shared-memory tier folder is made")
    ap.add_argument("--tier-size", type=float, default=8.0,
                    help="the shared-memory tier's budget, GiB (kv_offloading_size); a small one shows it held")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="write the figures (JSON) here")
    ap.add_argument("--copies", type=int, default=1, help="engines sharing the tier; a conversation moves each turn")
    ap.add_argument("--shape", help="a random-weight model of this real_sizes.py shape instead of --model")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 conversations x 3 short turns")
    args = ap.parse_args()
    args.load = {}
    if args.quick:
        args.conversations, args.turns, args.context, args.message, args.max_tokens = 8, 3, 256, 64, 8
        args.concurrency = 2
    torch.set_num_threads(args.threads)
    block = 16
    working_set = args.conversations * final_tokens(args)
    blocks = max(int(working_set * args.pool_share) // block, args.concurrency * (final_tokens(args) // block + 2))
    firsts, messages = conversations(args)
    folder = tempfile.mkdtemp(prefix="llm-cluster-kv-bench-", dir=args.shm)
    if args.shape:
        args.model, args.load = random_model(args.shape, folder), {"load_format": "dummy"}
    print(f"{args.conversations} conversations x {args.turns} turns, histories up to {final_tokens(args)} tokens "
          f"({working_set} in all), {args.concurrency} in flight; pool {blocks} blocks of {block} ({blocks * block} tokens) "
          f"per copy, {args.copies} cop{'y' if args.copies == 1 else 'ies'}; {args.shape or args.model}, {args.dtype}")
    try:
        results = {}
        tier_on = dict(kv_offloading_size=args.tier_size, kv_offloading_shm_path=str(Path(folder) / "tier"))
        for name, tier in (("off", {}), ("on", tier_on)):
            llms = [engine(args, blocks, tier) for _ in range(args.copies)]
            watch = FolderPeak(Path(folder) / "tier").start()
            results[name] = run(llms, firsts, messages, args)
            results[name]["tier_peak_bytes"], results[name]["tier_samples"] = watch.stop(), watch.samples
            per_copy = [llm.engine.stats() for llm in llms]
            results[name]["stats"] = {k: sum(getattr(st, k) for st in per_copy) for k in STATS}
            results[name]["tier_hit_tokens_per_copy"] = [st.kv_tier_hit_tokens for st in per_copy]
            del llms
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    off, on = results["off"], results["on"]
    for name, r in results.items():
        print(f"tier {name:3s}: TTFT p50 {r['ttft_p50_s'] * 1e3:8.1f} ms  p90 {r['ttft_p90_s'] * 1e3:8.1f} ms  "
              f"{r['turns_per_s']:6.2f} turns/s  {r['output_tok_s']:7.1f} output tok/s  ({r['wall_s']:.1f} s)")
    print(f"on / off : TTFT p50 {on['ttft_p50_s'] / off['ttft_p50_s']:.2f}x  p90 {on['ttft_p90_s'] / off['ttft_p90_s']:.2f}x  "
          f"throughput {on['output_tok_s'] / off['output_tok_s']:.2f}x")
    s = on["stats"]
    print(f"tier: {s['kv_tier_hit_tokens']} prompt tokens read instead of computed, "
          f"{s['kv_tier_bytes_read'] / 2**20:.1f} MiB read in {s['kv_tier_load_seconds']:.2f} s, "
          f"{s['kv_tier_bytes_written'] / 2**20:.1f} MiB written; pool hits {s['prefix_cache_hits']} "
          f"(off: {off['stats']['prefix_cache_hits']})")
    budget = args.tier_size * 2**30
    print(f"tier budget: {budget / 2**20:.1f} MiB; the folder's largest size in {on['tier_samples']} samples "
          f"{on['tier_peak_bytes'] / 2**20:.1f} MiB ({on['tier_peak_bytes'] / budget:.2f}x), "
          f"{s['kv_tier_evictions']} evictions; {s['kv_tier_writes_held']} blocks not written while it held "
          f"({s['kv_tier_blocks_written']} written)")
    if args.copies > 1:
        print(f"prompt tokens read from the tier, per copy: {on['tier_hit_tokens_per_copy']} (every turn after the "
              f"first lands on another copy than the one before)")
    differ = sum(on["answers"][k] != v for k, v in off["answers"].items())
    if differ:  # fp32 is token-identical; bf16 numerics may flip rare near-ties
        print(f"note: {differ}/{len(off['answers'])} answers differ between the runs")
    if args.out:
        for r in results.values():
            r.pop("answers")
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "blocks": blocks, **results}, f, indent=1)


if __name__ == "__main__":
    main()
