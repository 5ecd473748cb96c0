"""Deploy settings against each other over HTTP, alternating servers on the same requests.

Each variant is `deploy.yaml` (or --deploy) with the model set to --model and its own overrides of
the app's args (vs_vllm.ours_deploy), on the deploy file's port; every round starts one server per variant in turn (`serve_cli`, as `make serve`),
warms it with two requests, then streams --prompts random prompts of --input-len tokens,
--output-len tokens each, at --concurrency, and stops it. This VM-noise-prone kind of figure
(one server's median inter-token time moved 15% between runs here) is read from the medians over
rounds of each variant, and the ratio of those.

    .venv/bin/python benchmarks/deploy_ab.py --variants '{"ray": {"distributed_executor_backend": "ray"}, "uni": {}}'
        [--model PATH.gguf] [--concurrency 1] [--prompts 4] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vs_llamacpp import load_level, random_prompts, server  # noqa: E402
from vs_vllm import ROOT, ours_deploy, ours_env  # noqa: E402

METRICS = ("output_tok_s", "median_ttft_ms", "median_itl_ms")


def run_variant(args, name: str, overrides: dict, rnd: int) -> dict:
    """One server of `name`'s deploy file (vs_vllm.ours_deploy), warmed, then the measured load."""
    out_dir = Path(args.out_dir)
    deploy = ours_deploy(args.deploy, out_dir, model=args.model, served_model_name="m", **overrides)
    url = f"http://127.0.0.1:{yaml.safe_load(deploy.read_text())['http_options']['port']}"
    with server([sys.executable, "-m", "actors.serve_cli", str(deploy)], url, "/v1/models",
                out_dir / f"{name}-{rnd}.log", 600, env=ours_env()):
        asyncio.run(load_level(url, "m", random_prompts(2, args.input_len, seed=1), 1, args.output_len))
        prompts = random_prompts(args.prompts, args.input_len, seed=100)
        return asyncio.run(load_level(url, "m", prompts, args.concurrency, args.output_len))


def _commit() -> str:
    """HEAD, with "+dirty" when tracked files differ from it (the run measured those)."""
    git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return git("rev-parse", "HEAD") + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", required=True, help='JSON: {"name": {app arg: value}, ...}')
    ap.add_argument("--deploy", default=str(ROOT / "deploy.yaml"))
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the app's `model` (a GGUF path serves its blocks)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=str(ROOT / "build" / "deploy-ab"))
    ap.add_argument("--json", help="results file (default: <out-dir>/results.json)")
    args = ap.parse_args()
    variants = json.loads(args.variants)
    if args.model.endswith(".gguf"):
        variants = {n: {"quantization": "gguf", **o} for n, o in variants.items()}
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {name: [] for name in variants}
    for rnd in range(args.rounds):
        for name, overrides in variants.items():
            out = run_variant(args, name, overrides, rnd)
            runs[name].append({k: out[k] for k in METRICS})
            print(f"round {rnd} {name:>12s}: {out['output_tok_s']:7.1f} tok/s, TTFT p50 {out['median_ttft_ms']:7.1f} ms, "
                  f"ITL p50 {out['median_itl_ms']:6.1f} ms", flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in METRICS} for name, rs in runs.items()}
    first = next(iter(variants))
    for name, m in medians.items():
        print(f"median {name:>12s}: {m['output_tok_s']:7.1f} tok/s ({m['output_tok_s'] / medians[first]['output_tok_s']:.2f}x "
              f"{first}), TTFT p50 {m['median_ttft_ms']:7.1f} ms, ITL p50 {m['median_itl_ms']:6.1f} ms "
              f"({m['median_itl_ms'] / medians[first]['median_itl_ms']:.2f}x {first}'s)")
    result = {"variants": variants, "model": args.model, "concurrency": args.concurrency, "prompts": args.prompts,
              "input_len": args.input_len, "output_len": args.output_len, "runs": runs, "medians": medians,
              "commit": _commit()}
    path = Path(args.json or Path(args.out_dir) / "results.json")
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
