"""Serving benchmark: the running HTTP server vs the offline engine, same requests, same run.

Drives `/v1/completions` with streaming at each concurrency (default 1, 16, 64) and reports
request throughput, output tokens/s, TTFT, inter-token latency (per request, time per output
token after the first) and the gap between streamed chunks (p50 / p99). Then runs the
offline `LLM` (the same preset, in this process) on the same requests and prints the ratio of
HTTP output throughput at the highest concurrency to offline's.

The comparison alternates: --repeats times an HTTP run at the top concurrency, then an offline
run, both after a warm-up at full batch; it reports the median of each. Runs on a small shared
CPU machine vary by +-10%; alternating spreads that drift over both sides. The server stays up
(idle) during the offline runs, so both sides see the same background Ray processes.

Requests: random token-id prompts (fixed seed) of --input-len tokens, greedy, --output-len
new tokens each (ignore_eos), so both sides compute exactly the same tokens.

    make serve &                       # or: --start-server (starts serve_cli, stops it after)
    .venv/bin/python benchmarks/serve.py [--url http://127.0.0.1:8000] [--preset smollm2-cpu]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Result:
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)  # gaps between chunks that carry text
    latency: float = 0.0
    output_tokens: int = 0
    error: str | None = None


def make_prompts(n: int, length: int, seed: int, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(n)]


async def one_request(session, url: str, body: dict, headers: dict) -> Result:
    res, start = Result(), time.perf_counter()
    last = None
    async with session.post(url, json=body, headers=headers) as resp:
        if resp.status != 200:
            return Result(error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.error = chunk["error"]["message"]
                continue
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["text"]:
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
    res.latency = time.perf_counter() - start
    return res


async def run_level(base: str, model: str, api_key: str | None, prompts, output_len: int,
                    concurrency: int) -> tuple[float, list[Result]]:
    import aiohttp

    url = base.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=3600)

    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def limited(p):
            body = {"model": model, "prompt": p, "max_tokens": output_len, "temperature": 0.0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            async with sem:
                return await one_request(session, url, body, headers)

        start = time.perf_counter()
        results = await asyncio.gather(*[limited(p) for p in prompts])
        return time.perf_counter() - start, results


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def report_level(concurrency: int, elapsed: float, results: list[Result], output_len: int) -> float:
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"concurrency {concurrency}: {len(errors)} requests failed, e.g. {errors[0]}")
    tokens = sum(r.output_tokens for r in results)
    if tokens != output_len * len(results):
        raise SystemExit(f"concurrency {concurrency}: expected {output_len * len(results)} tokens, got {tokens}")
    ttft = [r.ttft for r in results]
    # A chunk may carry several tokens (the server's stream_interval): the inter-token latency
    # of a request is its mean time per output token after the first (vLLM's TPOT); the gap
    # between chunks is reported beside it.
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in results if r.output_tokens > 1]
    gaps = [x for r in results for x in r.itl]
    tput = tokens / elapsed
    print(f"{concurrency:>6} {len(results):>5} {len(results) / elapsed:>8.2f} {tput:>9.1f} "
          f"{pct(ttft, 50) * 1e3:>9.0f} {pct(ttft, 99) * 1e3:>9.0f} "
          f"{pct(tpot, 50) * 1e3:>8.1f} {pct(tpot, 99) * 1e3:>8.1f} "
          f"{pct(gaps, 50) * 1e3:>9.1f} {pct(gaps, 99) * 1e3:>9.1f}", flush=True)
    return tput


def load_offline(args):
    from cluster import LLM
    from cluster.config import EngineConfig

    preset = EngineConfig.from_preset(args.preset)
    if preset.parallel_config.tensor_parallel_size != 1:
        raise SystemExit("the offline engine runs TP=1 only; pick a TP=1 preset for the comparison")
    return LLM(preset.model_config.model, dtype=preset.model_config.dtype,
               max_model_len=preset.model_config.max_model_len,
               max_num_seqs=preset.scheduler_config.max_num_seqs,
               max_num_batched_tokens=preset.scheduler_config.max_num_batched_tokens,
               kv_cache_memory=preset.cache_config.kv_cache_memory,
               num_kv_blocks=preset.cache_config.num_kv_blocks,
               enable_prefix_caching=preset.cache_config.enable_prefix_caching)


def run_offline(llm, prompts, output_len: int) -> float:
    from cluster import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == output_len * len(prompts), tokens
    return tokens / elapsed


def start_server(deploy: str, port: int) -> subprocess.Popen:
    import requests

    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", deploy], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"serve_cli exited with {proc.returncode}")
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    raise SystemExit("the server did not become healthy in 15 minutes")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="served model name (default: the server's /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("LLM_CLUSTER_API_KEY"))
    ap.add_argument("--preset", default="smollm2-cpu", help="engine preset the server runs (offline side)")
    ap.add_argument("--concurrency", default="1,16,64")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per concurrency level >= 16")
    ap.add_argument("--num-requests-c1", type=int, default=8, help="requests at concurrency < 16")
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="alternating HTTP / offline runs at the top concurrency")
    ap.add_argument("--start-server", metavar="DEPLOY_YAML", default=None,
                    help="start `serve_cli DEPLOY_YAML` first (port from --url) and stop it at the end")
    args = ap.parse_args()

    import requests

    server = start_server(args.start_server, int(args.url.rsplit(":", 1)[1])) if args.start_server else None
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or requests.get(args.url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        levels = [int(c) for c in args.concurrency.split(",")]
        prompts = make_prompts(max(args.num_requests, args.num_requests_c1), args.input_len, args.seed)
        print(f"model {model}: {args.input_len} prompt tokens, {args.output_len} output tokens, greedy")
        top = max(levels)
        n = args.num_requests if top >= 16 else args.num_requests_c1
        asyncio.run(run_level(args.url, model, args.api_key, prompts[:n], 8, top))  # warm-up at full batch
        print(f"{'conc':>6} {'reqs':>5} {'req/s':>8} {'out tok/s':>9} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'chunk p50':>9} {'chunk p99':>9}   (ms)")
        http = {}
        for c in levels:
            k = args.num_requests if c >= 16 else args.num_requests_c1
            elapsed, results = asyncio.run(run_level(args.url, model, args.api_key, prompts[:k], args.output_len, c))
            http[c] = report_level(c, elapsed, results, args.output_len)
        if args.skip_offline:
            return
        llm = load_offline(args)
        run_offline(llm, prompts[:n], 8)  # warm-up at full batch
        http_runs, offline_runs = [http[top]], []
        for r in range(args.repeats):
            if r:
                elapsed, results = asyncio.run(run_level(args.url, model, args.api_key, prompts[:n],
                                                         args.output_len, top))
                http_runs.append(report_level(top, elapsed, results, args.output_len))
            offline_runs.append(run_offline(llm, prompts[:n], args.output_len))
            print(f"offline LLM, same {n} requests at once: {offline_runs[-1]:.1f} output tok/s", flush=True)
        h, o = statistics.median(http_runs), statistics.median(offline_runs)
        print(f"median of {len(http_runs)}: HTTP at concurrency {top} {h:.1f} tok/s, offline {o:.1f} tok/s")
        print(f"HTTP at concurrency {top} / offline: {h / o:.1%} (target >= 85%)")
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(120)


if __name__ == "__main__":
    main()
