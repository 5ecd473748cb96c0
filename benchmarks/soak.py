"""Soak: a mixed workload against `serve run` for a set time; fails if memory, descriptors or
KV blocks grow, or if any request ends other than it should.

    .venv/bin/python benchmarks/soak.py --minutes 30            # starts serve_cli on a soak deploy file
    .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid <serve_cli pid> --minutes 30

The server it starts is deploy.yaml's app on the `smollm2-cpu-ngram` preset (so decoding is
speculative), with its Responses store in a temporary directory. --concurrency clients loop
over a weighted mix: chat completions, completed streams, streams the client drops after a
few chunks, JSON-schema structured output (a few recurring schemas and a fresh one now and
then), n=3, the Responses API, and bad requests (each must be a 4xx naming the problem).

Every --sample-every-s it records, over serve_cli's whole process tree (Ray's processes are
its children when it started the local Ray): the proportional set size (PSS, so pages shared
between workers count once), open file descriptors, and the engine's KV blocks in use. After
--warmup-minutes (caches filling up is not a leak) it fits a line to each series and prints
its growth per hour. At the end the clients stop, and the engine must come back to no request
and no block in use.

Exit status 1 if PSS grows faster than --max-pss-mb-per-hour, descriptors faster than
--max-fds-per-hour, blocks or requests are left at the end, or any request had an unexpected
outcome (a 5xx, a cut stream, invalid structured output, a bad request answered 200). A
robustness run, not a speed comparison: there is no peer figure.
"""
from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

import psutil
import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve import start_server  # noqa: E402

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()
SCHEMAS = [{"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"], "additionalProperties": False},
           {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                             "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False},
           {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": WORDS[:6]},
                                                      "minItems": 1, "maxItems": 3}},
            "required": ["tags"], "additionalProperties": False}]
MIX = {"chat": 4, "stream": 3, "dropped_stream": 2, "structured": 2, "n3": 1, "responses": 1, "bad": 1}
TIMEOUT_S = 300  # a request's socket timeout (benchmarks/chaos.py lowers it to its deadline)


class Problem(str):
    """An unexpected outcome: its text (what the soak prints) and what benchmarks/chaos.py sorts
    it by: the HTTP status (200 for an error event in a stream), the OpenAI error object the
    server sent (None: none, or not of that shape), and `cut`: the answer stopped before its end."""

    def __new__(cls, text: str, status: int | None = None, error: dict | None = None, cut: bool = False):
        problem = super().__new__(cls, text)
        problem.status, problem.error, problem.cut = status, error, cut
        return problem


def http_problem(r: requests.Response, text: str | None = None) -> Problem:
    """An answer that is not the one expected: its status and its OpenAI error object, if any."""
    try:
        error = r.json().get("error")
    except (ValueError, AttributeError):
        error = None
    return Problem(text or f"{r.status_code} {r.text[:200]}", r.status_code, error if isinstance(error, dict) else None)


# ---- the workload --------------------------------------------------------------------------------
def copy_prompt(rng: random.Random) -> str:
    """A copy-heavy request: n-gram drafts find its words again in the prompt."""
    items = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 24)))
    return f"Repeat this list of words exactly, then stop: {items}"


def chat(base: str, model: str, rng: random.Random, **extra) -> requests.Response:
    body = {"model": model, "messages": [{"role": "user", "content": copy_prompt(rng)}],
            "max_tokens": rng.randint(16, 64), "temperature": rng.choice([0, 0.7]), **extra}
    return requests.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def expect(ok: bool, detail: str) -> str | None:
    return None if ok else detail


def run_chat(base, model, rng):
    r = chat(base, model, rng)
    if r.status_code != 200:
        return http_problem(r)
    ok = r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    return expect(ok, f"{r.status_code} {r.text[:200]}")


def run_n3(base, model, rng):
    r = chat(base, model, rng, n=3, temperature=0.8)
    if r.status_code != 200:
        return http_problem(r)
    ok = sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
    return expect(ok, f"{r.status_code} {r.text[:200]}")


def run_stream(base, model, rng, drop_after: int | None = None):
    body = {"model": model, "messages": [{"role": "user", "content": copy_prompt(rng)}], "stream": True,
            "max_tokens": rng.randint(32, 96), "stream_options": {"include_usage": True}}
    with requests.post(f"{base}/v1/chat/completions", json=body, stream=True, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            return http_problem(r)
        events = 0
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return None  # done (a dropped stream may end before the client drops it)
            event = json.loads(line[6:])
            if "error" in event:  # an OpenAI error event (not the word in a delta)
                error = event["error"] if isinstance(event["error"], dict) else None
                return Problem(f"error event: {line[:200]!r}", 200, error)
            events += 1
            if drop_after is not None and events >= drop_after:
                return None  # leaving the `with` closes the connection mid-stream
    return Problem("the stream ended without [DONE]", 200, cut=True)


def run_structured(base, model, rng):
    schema = rng.choice(SCHEMAS)
    if rng.random() < 0.1:  # now and then a schema nobody sent before: a fresh compile
        schema = {**SCHEMAS[0], "properties": {**SCHEMAS[0]["properties"],
                                               "name": {"type": "string", "maxLength": rng.randint(25, 2000)}}}
    r = chat(base, model, rng, max_tokens=96, temperature=0,
             response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}})
    if r.status_code != 200:
        return http_problem(r)
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "length":
        return None  # cut by max_tokens: not a complete object, and not claimed to be one
    try:
        value = json.loads(choice["message"]["content"])
    except json.JSONDecodeError:
        return f"invalid JSON: {choice['message']['content'][:200]}"
    return expect(set(schema["required"]) <= set(value), f"missing keys: {value}")


def run_responses(base, model, rng):
    body = {"model": model, "input": copy_prompt(rng), "max_output_tokens": 48, "store": rng.random() < 0.5}
    r = requests.post(f"{base}/v1/responses", json=body, timeout=TIMEOUT_S)
    if r.status_code != 200:
        return http_problem(r)
    ok = r.json()["status"] in ("completed", "incomplete")
    return expect(ok, f"{r.status_code} {r.text[:200]}")


BAD = [  # (path, body, status expected)
    ("/v1/chat/completions", {"model": "{model}", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400),
    ("/v1/chat/completions", {"model": "{model}", "messages": "not a list"}, 400),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("/v1/completions", {"model": "{model}", "prompt": "hi", "max_tokens": 10_000_000}, 400),
    ("/v1/chat/completions", {"model": "{model}", "messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, 400),
]


def run_bad(base, model, rng):
    path, body, status = rng.choice(BAD)
    body = json.loads(json.dumps(body).replace("{model}", model))
    r = requests.post(f"{base}{path}", json=body, timeout=60)
    problem = http_problem(r, f"{path} {body}: expected {status}, got {r.status_code} {r.text[:200]}")
    return None if r.status_code == status and (problem.error or {}).get("message") else problem


RUNNERS = {"chat": run_chat, "stream": run_stream, "structured": run_structured, "n3": run_n3,
           "responses": run_responses, "bad": run_bad,
           "dropped_stream": lambda b, m, rng: run_stream(b, m, rng, drop_after=rng.randint(1, 4))}


def client(base: str, model: str, seed: int, stop: threading.Event, counts: Counter, failures: list) -> None:
    rng = random.Random(seed)
    kinds, weights = zip(*MIX.items())
    while not stop.is_set():
        kind = rng.choices(kinds, weights)[0]
        try:
            problem = RUNNERS[kind](base, model, rng)
        except Exception as exc:  # a dropped connection or a timeout is a failure too
            problem = repr(exc)
        counts[kind, "ok" if problem is None else "failed"] += 1
        if problem is not None:
            failures.append((kind, problem))


# ---- sampling ------------------------------------------------------------------------------------
ROLES: dict[int, str] = {}  # pid -> what the process was when first seen


def role(p: psutil.Process) -> str:
    """What a process is: its Ray title when first seen (a worker's title then changes with
    the method it runs, e.g. ray::WorkerActor.execute) or its executable, with its pid."""
    if p.pid not in ROLES:
        cmd = p.cmdline()
        name = cmd[0].split(" ")[0] if cmd and cmd[0].startswith("ray::") else p.name()
        ROLES[p.pid] = f"{name} [{p.pid}]"
    return ROLES[p.pid]


def sample_tree(pid: int) -> tuple[dict[str, float], int]:
    """PSS in MB by process, and open file descriptors, over `pid` and its descendants."""
    pss, fds = defaultdict(float), 0
    root = psutil.Process(pid)
    for p in [root, *root.children(recursive=True)]:
        try:
            pss[role(p)] += p.memory_full_info().pss / 2**20
            fds += p.num_fds()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return dict(pss), fds


def engine_stats(base: str) -> dict:
    r = requests.get(f"{base}/engine/stats", timeout=30)
    r.raise_for_status()
    return r.json()


def slope_per_hour(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 3:
        return 0.0
    n = len(points)
    mx, my = sum(t for t, _ in points) / n, sum(v for _, v in points) / n
    var = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if var == 0 else sum((t - mx) * (v - my) for t, v in points) / var * 3600


# ---- the run -------------------------------------------------------------------------------------
def soak_deploy(out: Path, port: int) -> Path:
    cfg = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(preset="smollm2-cpu-ngram",
                                          response_store={"directory": str(out.parent / "store")})
    out.write_text(yaml.safe_dump(cfg))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30)
    ap.add_argument("--warmup-minutes", type=float, default=5)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--sample-every-s", type=float, default=30)
    ap.add_argument("--url", help="a running server (default: start serve_cli on a soak deploy file)")
    ap.add_argument("--pid", type=int, help="with --url: serve_cli's pid, whose process tree is sampled")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--max-pss-mb-per-hour", type=float, default=100.0)
    ap.add_argument("--max-fds-per-hour", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the samples and the verdict here")
    args = ap.parse_args()
    if args.url and args.pid is None:
        ap.error("--url needs --pid (serve_cli's process id) to sample memory")

    proc = None
    if args.url:
        base, pid = args.url.rstrip("/"), args.pid
    else:
        tmp = Path(tempfile.mkdtemp(prefix="soak-"))
        proc = start_server(str(soak_deploy(tmp / "deploy.yaml", args.port)), args.port)
        base, pid = f"http://127.0.0.1:{args.port}", proc.pid
    try:
        return soak(args, base, pid)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()


def soak(args, base: str, pid: int) -> int:
    model = requests.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
    stop, counts, failures = threading.Event(), Counter(), []
    threads = [threading.Thread(target=client, args=(base, model, args.seed + i, stop, counts, failures), daemon=True)
               for i in range(args.concurrency)]
    start = time.monotonic()
    for t in threads:
        t.start()
    samples = []
    print(f"soak: {args.concurrency} clients for {args.minutes:g} min against {base} (serve_cli pid {pid})", flush=True)
    while (elapsed := time.monotonic() - start) < args.minutes * 60:
        pss, fds = sample_tree(pid)
        stats = engine_stats(base)
        blocks = stats["num_blocks"] - stats["num_free_blocks"]
        samples.append({"t": elapsed, "pss_mb": pss, "fds": fds, "kv_blocks_in_use": blocks,
                        "requests": sum(counts.values())})
        print(f"{elapsed / 60:6.1f} min  PSS {sum(pss.values()):8.1f} MB  fds {fds:5d}  KV blocks {blocks:5d}  "
              f"requests {sum(counts.values()):6d}  failures {len(failures)}", flush=True)
        time.sleep(max(0.0, min(args.sample_every_s, args.minutes * 60 - elapsed)))
    stop.set()
    for t in threads:
        t.join(330)
    return verdict(args, base, samples, counts, failures)


def verdict(args, base: str, samples: list[dict], counts: Counter, failures: list) -> int:
    deadline = time.monotonic() + 120
    while (end := engine_stats(base))["num_unfinished"] and time.monotonic() < deadline:
        time.sleep(1)
    blocks_left = end["num_blocks"] - end["num_free_blocks"]
    steady = [s for s in samples if s["t"] >= args.warmup_minutes * 60]
    total = slope_per_hour([(s["t"], sum(s["pss_mb"].values())) for s in steady])
    fds = slope_per_hour([(s["t"], s["fds"]) for s in steady])
    roles = sorted({r for s in steady for r in s["pss_mb"]})
    by_role = {r: slope_per_hour([(s["t"], s["pss_mb"][r]) for s in steady if r in s["pss_mb"]]) for r in roles}

    print("\nrequests by kind (ok / failed): " + ", ".join(
        f"{k} {counts[k, 'ok']}/{counts[k, 'failed']}" for k in MIX))
    for kind, problem in failures[:20]:
        print(f"  failed {kind}: {problem}")
    if steady:
        print(f"PSS {sum(steady[0]['pss_mb'].values()):.0f} -> {sum(steady[-1]['pss_mb'].values()):.0f} MB "
              f"after warm-up; growth {total:+.1f} MB/h (limit {args.max_pss_mb_per_hour:g})")
        for r, v in sorted(by_role.items(), key=lambda kv: -abs(kv[1]))[:6]:
            print(f"  {r:40s} {v:+8.1f} MB/h")
        print(f"open fds {steady[0]['fds']} -> {steady[-1]['fds']}; growth {fds:+.1f}/h (limit {args.max_fds_per_hour:g})")
        print(f"KV blocks in use while running: max {max(s['kv_blocks_in_use'] for s in samples)} "
              f"of {end['num_blocks']}; at the end {blocks_left}, requests left {end['num_unfinished']}")
    problems = []
    if failures:
        problems.append(f"{len(failures)} requests had an unexpected outcome")
    if total > args.max_pss_mb_per_hour:
        problems.append(f"PSS grows {total:.1f} MB/h")
    if fds > args.max_fds_per_hour:
        problems.append(f"open fds grow {fds:.1f}/h")
    if blocks_left or end["num_unfinished"]:
        problems.append(f"{blocks_left} KV blocks and {end['num_unfinished']} requests left after the run")
    if len(steady) < 3:
        problems.append("too few samples after the warm-up to measure growth")
    print("FAIL: " + "; ".join(problems) if problems else "PASS", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"samples": samples, "pss_mb_per_hour": total, "fds_per_hour": fds,
                                               "pss_mb_per_hour_by_role": by_role, "problems": problems,
                                               "counts": {f"{k}:{v}": n for (k, v), n in counts.items()}}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
