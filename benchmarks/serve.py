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

`--workload shared-prefix` compares the engine routers instead, at two engine replicas, in one
run: chat sessions (--sessions, --turns each) that open with one of --num-prefixes long system
prompts (--prefix-len tokens); each turn adds a user message (--user-len) to the history, and
the assistant's previous reply (--output-len tokens, synthetic, so both routers see the same
prompts). Sessions run --session-concurrency at a time, each turn after the previous one finished. It
alternates the prefix-aware router and power-of-two --repeats times (fresh system prompts each
round, so no run starts with the other's cache) and reports TTFT, throughput and the fleet's
prefix-cache hit rate (cached prompt tokens / prompt tokens, from the responses' usage):

    .venv/bin/python benchmarks/serve.py --workload shared-prefix --start-server deploy.yaml
    .venv/bin/python benchmarks/serve.py --workload shared-prefix \
        --url http://host:8000/affinity --compare-url http://host:8000/p2c   # apps you started
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
    prompt_tokens: int = 0
    cached_tokens: int = 0
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
                usage = chunk["usage"]
                res.output_tokens, res.prompt_tokens = usage["completion_tokens"], usage["prompt_tokens"]
                res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
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
    """Every prompt once, `concurrency` at a time: sessions of one turn."""
    return await run_sessions(base, model, api_key, [[p] for p in prompts], output_len, concurrency)


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


def start_server(deploy: str, port: int, routes: tuple[str, ...] = ("",), env: dict[str, str] | None = None,
                 log: Path | None = None) -> subprocess.Popen:
    """serve_cli on `deploy` (with `env` over this process's environment, its output to `log`),
    once every route answers /health."""
    import requests

    out = open(log, "w") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(deploy)], cwd=ROOT,
                            env={**os.environ, **(env or {})}, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        try:
            if all(requests.get(f"http://127.0.0.1:{port}{r}/health", timeout=5).status_code == 200 for r in routes):
                return proc
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"serve_cli exited with {proc.returncode}")
        time.sleep(1)
    proc.send_signal(signal.SIGTERM)
    raise SystemExit("the server did not become healthy in 15 minutes")


# ---- shared-prefix workload: prefix-aware vs power-of-two routing --------------------------------
ROUTERS = {"affinity": "prefix_affinity", "p2c": "power_of_two"}


def router_deploy(deploy: str, out: Path) -> tuple[Path, int]:
    """`deploy`'s first application twice, at /affinity and /p2c: two engine replicas each,
    one app per router. Returns the new file and its HTTP port."""
    import yaml

    cfg = yaml.safe_load(Path(deploy).read_text())
    base = cfg["applications"][0]
    args = {k: v for k, v in base.get("args", {}).items() if k != "engine_autoscaling_config"}
    # Four engine copies must fit the node's logical CPUs; the two copies of the app being
    # measured share its cores (the other app idles).
    args.setdefault("engine_num_cpus", 0.05)
    args.setdefault("worker_num_cpus", 0.1)
    args.setdefault("worker_torch_threads", max(1, (os.cpu_count() or 2) // (2 * args.get("tensor_parallel_size", 1))))
    cfg["applications"] = [{**base, "name": name, "route_prefix": f"/{name}",
                            "args": {**args, "engine_replicas": 2, "request_router": router}}
                           for name, router in ROUTERS.items()]
    out.write_text(yaml.safe_dump(cfg))
    return out, int(cfg.get("http_options", {}).get("port", 8000))


def chat_sessions(args, seed: int) -> list[list[list[int]]]:
    """Per session, the prompt of each turn: system prompt, then user / assistant turns."""
    rng = random.Random(seed)
    systems = make_prompts(args.num_prefixes, args.prefix_len, seed)
    sessions = []
    for s in range(args.sessions):
        history, turns = list(systems[s % args.num_prefixes]), []
        for _ in range(args.turns):
            history += [rng.randrange(100, 49000) for _ in range(args.user_len)]
            turns.append(list(history))
            history += [rng.randrange(100, 49000) for _ in range(args.output_len)]  # the "reply"
        sessions.append(turns)
    rng.shuffle(sessions)
    return sessions


async def run_sessions(base: str, model: str, api_key: str | None, sessions, output_len: int,
                       concurrency: int) -> tuple[float, list[Result]]:
    import aiohttp

    url = base.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        async def chat(turns):
            out = []
            async with sem:
                for prompt in turns:
                    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    out.append(await one_request(session, url, body, headers))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*[chat(t) for t in sessions])
        return time.perf_counter() - start, [r for turns in results for r in turns]


def report_routing(name: str, round_: int, elapsed: float, results: list[Result]) -> dict[str, float]:
    errors = [r.error for r in results if r.error]
    if errors:
        raise SystemExit(f"{name}: {len(errors)} requests failed, e.g. {errors[0]}")
    row = {"req/s": len(results) / elapsed, "out tok/s": sum(r.output_tokens for r in results) / elapsed,
           "TTFT p50": pct([r.ttft for r in results], 50) * 1e3, "TTFT p99": pct([r.ttft for r in results], 99) * 1e3,
           "hit rate": sum(r.cached_tokens for r in results) / max(1, sum(r.prompt_tokens for r in results))}
    print(f"{name:>10} {round_:>5} " + " ".join(f"{v:>10.3f}" if k == "hit rate" else f"{v:>10.1f}"
                                               for k, v in row.items()), flush=True)
    return row


def main_shared_prefix(args) -> None:
    import tempfile

    import requests

    server = None
    if args.start_server:
        deploy, port = router_deploy(args.start_server, Path(tempfile.mkdtemp()) / "routers.yaml")
        server = start_server(str(deploy), port, routes=tuple(f"/{n}" for n in ROUTERS))
        urls = {n: f"http://127.0.0.1:{port}/{n}" for n in ROUTERS}
    elif args.compare_url:
        urls = {"affinity": args.url, "p2c": args.compare_url}
    else:
        raise SystemExit("--workload shared-prefix needs --start-server DEPLOY, or --url and --compare-url")
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or requests.get(urls["affinity"] + "/v1/models", headers=headers,
                                           timeout=30).json()["data"][0]["id"]
        print(f"model {model}: {args.sessions} sessions x {args.turns} turns, {args.num_prefixes} system "
              f"prompts of {args.prefix_len} tokens, +{args.user_len} per user turn, {args.output_len} out, "
              f"{args.session_concurrency} sessions at a time; two engine replicas per router")
        for name, url in urls.items():  # warm-up, on prompts no measured round uses
            asyncio.run(run_sessions(url, model, args.api_key, chat_sessions(args, args.seed - 1)[:4], 4, 4))
        print(f"{'router':>10} {'round':>5} {'req/s':>10} {'out tok/s':>10} {'TTFT p50':>10} {'TTFT p99':>10} "
              f"{'hit rate':>10}   (ms)")
        rows: dict[str, list[dict]] = {n: [] for n in urls}
        for r in range(args.repeats):
            sessions = chat_sessions(args, args.seed + r)
            for name, url in urls.items():
                elapsed, results = asyncio.run(run_sessions(url, model, args.api_key, sessions,
                                                            args.output_len, args.session_concurrency))
                rows[name].append(report_routing(name, r, elapsed, results))
        med = {n: {k: statistics.median(row[k] for row in rs) for k in rs[0]} for n, rs in rows.items()}
        a, p = med["affinity"], med["p2c"]
        print(f"median of {args.repeats}: prefix-aware / power-of-two: "
              f"output tok/s {a['out tok/s'] / p['out tok/s']:.2f}x, "
              f"TTFT p50 {a['TTFT p50'] / p['TTFT p50']:.2f}x, p99 {a['TTFT p99'] / p['TTFT p99']:.2f}x, "
              f"hit rate {a['hit rate']:.1%} vs {p['hit rate']:.1%}")
    finally:
        if server is not None:
            server.send_signal(signal.SIGTERM)
            server.wait(120)


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
    ap.add_argument("--workload", choices=("random", "shared-prefix"), default="random")
    ap.add_argument("--compare-url", default=None, help="shared-prefix: the power-of-two app (--url: prefix-aware)")
    ap.add_argument("--sessions", type=int, default=64, help="shared-prefix: chat sessions")
    ap.add_argument("--turns", type=int, default=3, help="shared-prefix: requests per session")
    ap.add_argument("--num-prefixes", type=int, default=8, help="shared-prefix: distinct system prompts")
    ap.add_argument("--prefix-len", type=int, default=768, help="shared-prefix: system prompt tokens")
    ap.add_argument("--user-len", type=int, default=64, help="shared-prefix: tokens per user turn")
    ap.add_argument("--session-concurrency", type=int, default=16, help="shared-prefix: sessions at a time")
    args = ap.parse_args()
    if args.workload == "shared-prefix":
        return main_shared_prefix(args)

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
