"""Where one decode step's time goes, at batch 64 and 128 (issue "Performance against the real peer").

The offline engine (SmolLM2, bf16, CPU) runs B requests of random 128-token prompts; once all are
decoding, each of `--steps` steps is split into the phases below by wrapping the functions that do
them. "outside the model" is what async scheduling could overlap with the forward pass:

  schedule       Scheduler.schedule
  batch update   the runner's request states and rank 0's persistent batch (ModelRunner._update_states,
                 SamplingStep.update)
  inputs         ModelRunner._prepare_inputs (token ids, positions, block tables)
  model          ModelRunner._forward (attention metadata + the forward pass)
  lm head        model.compute_logits
  sample         SamplingStep.sample (processors, sampler, result)
  engine update  EngineCore._update (append tokens, stop checks, outputs)
  rest           the step minus the above (msgspec plan / result, executor call)

    .venv/bin/python benchmarks/step_profile.py [--batches 64,128] [--steps 20]

`--ops` (issue "Per-step overhead") takes batch-1 decode apart: the step as above, then torch's
profiler over the same steps, every op's own time summed by kind (GEMMs, attention, the fused
elementwise kernels, the rest), the time between ops (Python and dispatch: the step's wall time
less its ops' own time), and the bandwidth limit: the bytes of weights a step must read (every
projection and the LM head) over this machine's measured read bandwidth; then that ratio again
in 9 rounds, each reading the bandwidth just before its own steps (the VM drifts), and their median.

    .venv/bin/python benchmarks/step_profile.py --ops [--steps 64] [--json out.json]

`--ray` times the same decode steps as the engine actor runs them: the engine in this process,
the model in a worker actor (local Ray on 127.0.0.1), once with plain and once with async
scheduling (vLLM's; `async_scheduling` in the config), and prints ms per step for both: what
async scheduling takes off a step once the engine's work and the Ray round trip overlap the
forward pass.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections import defaultdict

PHASES = ["schedule", "batch update", "inputs", "model", "lm head", "sample", "engine update"]
OUTSIDE = ["schedule", "batch update", "inputs", "engine update", "rest"]


class Timers:
    def __init__(self) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, obj, attr: str, phase: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[phase] += time.perf_counter() - t0

        setattr(obj, attr, timed)


def profile(batch: int, steps: int, prompt_len: int) -> dict[str, float]:
    from cluster import LLM

    llm = LLM(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 8))
    core = llm.engine
    runner = core.executor.worker.runner
    timers = Timers()
    timers.wrap(core.scheduler, "schedule", "schedule")
    timers.wrap(core, "_update", "engine update")
    timers.wrap(runner, "_update_states", "batch update")
    timers.wrap(runner.sampling, "update", "batch update")
    timers.wrap(runner, "_prepare_inputs", "inputs")
    timers.wrap(runner, "_forward", "model")
    timers.wrap(runner.model, "compute_logits", "lm head")
    timers.wrap(runner.sampling, "sample", "sample")
    total = time_decode_steps(core, batch, steps, prompt_len, timers)
    out = {k: v / steps * 1e3 for k, v in timers.totals.items()}
    out["rest"] = total / steps * 1e3 - sum(out.values())
    out["step"] = total / steps * 1e3
    return out


def time_decode_steps(core, batch: int, steps: int, prompt_len: int, timers: Timers | None = None,
                      during=None) -> float:
    """Seconds for `steps` steps once all `batch` requests decode (random prompts, greedy);
    `timers` run, and the context manager `during` (a profiler) is entered, for those steps only."""
    from cluster import SamplingParams
    from cluster.messages import EngineRequest

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        core.add_request(EngineRequest(str(i), [rng.randrange(100, 49000) for _ in range(prompt_len)], params))
    started: set[str] = set()
    while len(started) < batch:  # until every request has its first token: all decode from here
        started.update(out.request_id for out in core.step())
    if timers is not None:
        timers.on = True
    with during if during is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            core.step()
        total = time.perf_counter() - t0
    if timers is not None:
        timers.on = False
    while core.has_unfinished():
        core.step()
    return total


# Op name fragments -> kind, first match wins (self times, so a parent never counts its children).
OP_KINDS = [("decoder layers (one call)", ("decoder_layers",)),  # every layer's GEMMs, attention and norms at once
            ("GEMM", ("_linear_pointwise", "skinny_linear", "aten::mm", "aten::addmm", "aten::bmm", "aten::linear")),
            ("attention", ("paged_attention", "qkv_attention")),
            ("fused elementwise", ("rms_norm", "silu_and_mul", "rotary_", "fused_add")),
            ("sampling", ("argmax", "topk", "softmax", "sort", "multinomial", "exponential"))]


def weight_bytes_per_step(model) -> int:
    """Bytes every decode step reads whatever the batch: each projection's weight and the LM head
    (the embedding reads one row per token, the norms are negligible)."""
    from cluster.model.layers.linear import LinearBase

    cfg, elt = model.config, next(model.parameters()).element_size()
    linears = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, LinearBase))
    return (linears + cfg.vocab_size * cfg.hidden_size) * elt


def read_bandwidth(gib: float = 1.0):
    """A probe of the bytes/s torch reads from DRAM on this machine's threads (a sum over a buffer
    far larger than the caches, on huge pages as the streamed weights are): the ceiling a
    weight-streaming decode step runs into. probe(repeats) -> the best of `repeats` sums. On 4 KB
    pages this VM read 34-58 GB/s from run to run."""
    import torch

    from cluster.model.huge_pages import zeros_on_huge_pages

    buf = zeros_on_huge_pages((int(gib * 2**30) // 4,), torch.float32).fill_(1.0)
    buf.sum()

    def probe(repeats: int = 5) -> float:
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        return buf.numel() * 4 / best

    return probe


def paired_bandwidth_ratios(core, nbytes: int, probe, rounds: int, steps: int, prompt_len: int) -> list[float]:
    """The step over the bandwidth limit, each round's bandwidth read (`probe`) just before its
    steps: this VM's speed drifts 10-20% between runs (and within one), so a step and a bandwidth
    measured apart can be ratioed against different machines."""
    ratios = []
    for _ in range(rounds):
        limit_ms = nbytes / probe(3) * 1e3
        ratios.append(time_decode_steps(core, 1, steps, prompt_len) / steps * 1e3 / limit_ms)
    return ratios


def profile_ops(steps: int, prompt_len: int) -> dict[str, float]:
    import torch
    from torch.profiler import ProfilerActivity, profile as torch_profile

    from cluster import LLM

    llm = LLM(max_num_seqs=1)
    core = llm.engine
    core.warm_up()
    plain = time_decode_steps(core, 1, steps, prompt_len) / steps * 1e3
    phases = profile(1, steps, prompt_len)
    prof = torch_profile(activities=[ProfilerActivity.CPU])
    profiled = time_decode_steps(core, 1, steps, prompt_len, during=prof) / steps * 1e3
    kinds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        kind = next((k for k, frags in OP_KINDS if any(f in event.key for f in frags)), "other ops")
        kinds[kind] += event.self_cpu_time_total / 1e3 / steps  # ms per step (all steps profiled)
    model = core.executor.worker.runner.model
    probe = read_bandwidth()
    nbytes, bandwidth = weight_bytes_per_step(model), probe()
    ratios = paired_bandwidth_ratios(core, nbytes, probe, rounds=9, steps=steps, prompt_len=prompt_len)
    out = {"step_ms": plain, "profiled_step_ms": profiled, "tok_s": 1e3 / plain, "paired_ratios": ratios,
           "weights_mb": nbytes / 1e6, "read_gb_s": bandwidth / 1e9, "bandwidth_limit_ms": nbytes / bandwidth * 1e3,
           "threads": torch.get_num_threads(), **{f"phase {k}": v for k, v in phases.items()},
           **{f"ops {k}": v for k, v in kinds.items()}}
    out["between ops (profiled step less op self times)"] = profiled - sum(kinds.values())
    return out


def print_ops(ms: dict[str, float]) -> None:
    step = ms["step_ms"]
    print(f"batch 1 decode: {step:.1f} ms per step ({ms['tok_s']:.1f} tok/s, {ms['threads']} threads); "
          f"weights read per step {ms['weights_mb']:.0f} MB at {ms['read_gb_s']:.1f} GB/s = "
          f"{ms['bandwidth_limit_ms']:.1f} ms bandwidth limit ({step / ms['bandwidth_limit_ms']:.2f}x of it)")
    ratios = sorted(ms["paired_ratios"])
    print(f"  step / bandwidth limit, {len(ratios)} rounds each reading the bandwidth just before its steps: "
          f"median {ratios[len(ratios) // 2]:.2f}x (" + " ".join(f"{r:.2f}" for r in ratios) + ")")
    print("  phases (wall, unprofiled):")
    for phase in PHASES + ["rest"]:
        print(f"    {phase:16s} {ms['phase ' + phase]:7.2f} ms")
    print(f"  ops' own time under torch.profiler (step {ms['profiled_step_ms']:.1f} ms there):")
    for key in sorted(k for k in ms if k.startswith("ops ")):
        print(f"    {key[4:]:16s} {ms[key]:7.2f} ms")
    gap = ms["between ops (profiled step less op self times)"]
    print(f"    {'between ops':16s} {gap:7.2f} ms  (Python, dispatch, the profiler's own cost)")


def profile_ray(batches: list[int], steps: int, prompt_len: int) -> None:
    from actors.env import apply_loopback_env
    apply_loopback_env()  # before Ray is imported: it reads the loopback settings then
    import ray

    from actors.engine_replica.executor import RayExecutor
    from cluster.config import EngineConfig
    from cluster.engine.engine_core import EngineCore

    ray.init(address="local", _node_ip_address="127.0.0.1", num_cpus=4, include_dashboard=False,
             log_to_driver=False)
    try:
        for batch in batches:
            ms = {}
            for async_scheduling in (False, True):
                config = EngineConfig.create(max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * 8),
                                             async_scheduling=async_scheduling).finalize()
                executor = RayExecutor(config, worker_num_cpus=1.0)
                try:
                    core = EngineCore(config, executor)
                    core.warm_up()
                    ms[async_scheduling] = time_decode_steps(core, batch, steps, prompt_len) / steps * 1e3
                finally:
                    executor.shutdown()
            print(f"batch {batch} over Ray: {ms[False]:.1f} ms per decode step, async scheduling "
                  f"{ms[True]:.1f} ms ({ms[False] / ms[True]:.3f}x)", flush=True)
    finally:
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="64,128")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--ray", action="store_true", help="plain vs async scheduling through a worker actor")
    ap.add_argument("--ops", action="store_true", help="batch 1: op kinds, time between ops, bandwidth limit")
    ap.add_argument("--json", help="with --ops: write the figures here")
    args = ap.parse_args()
    if args.ops:
        ms = profile_ops(args.steps, args.prompt_len)
        print_ops(ms)
        if args.json:
            import json

            with open(args.json, "w") as fh:
                json.dump(ms, fh, indent=2)
        return
    if args.ray:
        profile_ray([int(b) for b in args.batches.split(",")], args.steps, args.prompt_len)
        return
    for batch in (int(b) for b in args.batches.split(",")):
        ms = profile(batch, args.steps, args.prompt_len)
        outside = sum(ms[p] for p in OUTSIDE)
        print(f"\nbatch {batch}: {ms['step']:.1f} ms per decode step, {batch / ms['step'] * 1e3:.0f} tok/s")
        for phase in PHASES + ["rest"]:
            print(f"  {phase:14s} {ms[phase]:7.2f} ms  {ms[phase] / ms['step'] * 100:5.1f}%")
        print(f"  outside the model (what async scheduling could hide): {outside:.2f} ms, "
              f"{outside / ms['step'] * 100:.1f}% of the step")


if __name__ == "__main__":
    main()
