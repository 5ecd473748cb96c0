"""Chaos (issue 40): mixed traffic against `serve_cli` while a driver SIGKILLs one of the server's
components at random every 30-60 s; every request must end as the fault table of
docs/deploying.md says, every component must come back, and nothing may be left behind.

    .venv/bin/python benchmarks/chaos.py                                  # 20 min, starts serve_cli
    .venv/bin/python benchmarks/chaos.py --minutes 4 --kill-every-s 30 --json chaos.json
    .venv/bin/python benchmarks/chaos.py --url http://127.0.0.1:8000 --pid <serve_cli pid> \\
        [--dashboard http://127.0.0.1:8265]                              # a server you started

The server it starts is deploy.yaml's app (SmolLM2 on the CPU) with 2 engine copies and 2 ingress
replicas (so one of each can fail), LoRA on with tests/lora_cases.py's three peft adapters made
for SmolLM2's weights (random A and B, nothing downloaded) served from `lora_modules` with
`max_loras: 2`, the Responses store in a temporary directory, `step_timeout_s` generous, and
small CPU reservations with one torch thread per worker (it runs on 2 cores).

--concurrency clients loop over a weighted mix (soak.py's runners, and two of its own): chat,
streams, streams the client drops, JSON-schema output, n=3, the Responses API, Responses chains
(`previous_response_id` over a response stored just before, or one stored earlier in the run, so
across store restarts), chat and streams on a LoRA adapter (the adapter as `model`), bad requests.

Every --kill-every-s to twice that, the driver SIGKILLs one component, in a random order that
goes through all of them before repeating: a TP worker (`ray::WorkerActor`), an engine copy
(`ray::ServeReplica:<app>:engine`), an ingress replica, the grammar compiler (once a copy's
first structured request has started one), the `response-store` replica, Serve's controller, Serve's HAProxy. Each is found by its process
title in serve_cli's process tree. Then it waits until the server is as it started: `/health`
200, the app RUNNING with each deployment's replicas RUNNING at their starting counts (Serve's
REST API on the Ray dashboard), the proxies healthy, as many processes of each component as at
the start, grammar compilers at most one per copy (twice in a row). A component not back within --recover-s gets a restart (recorded):
a worker or compiler's engine copy is killed (Serve starts a fresh one), Serve's controller is
killed for a replica Serve did not replace, HAProxy's manager for HAProxy, the app is deployed
again through the REST API for the controller. Not back --recover-s after that: the run fails.

Each request ends as one of:
- finished: the answer expected (a bad request's 4xx naming the problem included);
- failed with an error: a 503 or 408 whose body (or SSE error event) is OpenAI's error shape
  with a message (a failed engine copy, the store unavailable, a full queue);
- cut in flight: the connection closed, or a stream ended without [DONE], while it was in
  flight within CUT_GRACE_S of the kill of an ingress replica or of HAProxy;
- refused: no connection while HAProxy was down (from its kill until the server recovered);
- lost, which fails the run: anything else (another 5xx, a 4xx to a good request, a cut with no
  such kill around it, a malformed answer, no answer within --deadline-s).

At the end the clients stop, every engine copy must come back to no request and no KV block in
use (`/engine/stats`, asked until each copy has answered), serve_cli is stopped with SIGTERM and
no process of its sessions, nor any process of its tree seen during the run, may remain; the
peak PSS of the tree must stay under --max-pss-mb. Exit status 1 on any loss or any of these.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil
import requests
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(1, str(ROOT))
import soak  # noqa: E402
from actors.env import loopback_port  # noqa: E402
from serve import start_server  # noqa: E402

# Like tests/actors/fleet_helpers.py's SMALL: logical CPUs are a budget, not cores, so two engine
# copies and two ingress replicas fit a 2-core machine.
SMALL = {"engine_num_cpus": 0.05, "worker_num_cpus": 0.1, "ingress_num_cpus": 0.05, "worker_torch_threads": 1}
STEP_TIMEOUT_S = 60.0  # far above a 2,048-token prefill chunk on 2 busy cores (seconds)
COMPONENTS = {  # kind -> process title ({app}: the application's name); HAProxy: its executable
    "worker": "ray::WorkerActor", "engine": "ray::ServeReplica:{app}:engine",
    "ingress": "ray::ServeReplica:{app}:ingress", "grammar": "ray::GrammarCompilerActor",
    "store": "ray::ServeReplica:{app}:response-store", "controller": "ray::ServeController", "haproxy": "haproxy"}
LAZY_KINDS = ("grammar",)  # started by a copy's first request that needs one: 0 or 1 per copy
CUT_KINDS = ("ingress", "haproxy")  # kills that may cut a connection in flight
CUT_GRACE_S = 5.0  # how far from a kill a cut may be put down to it
ERROR_STATUSES = (503, 408)  # the documented failures: a failed copy, the store, the queue; a deadline
MIX = {"chat": 3, "stream": 3, "dropped_stream": 1, "structured": 2, "n3": 1, "responses": 1, "response_chain": 2,
       "lora": 2, "bad": 1}
ADAPTERS: list[str] = []  # the LoRA adapters the server lists (set at the start)
STORED: list[str] = []  # ids of responses stored during the run (continued by later chains)


# ---- the server ------------------------------------------------------------------------------------
def make_lora_adapters(root: Path) -> dict[str, str]:
    """tests/lora_cases.py's peft adapters, made for SmolLM2's weights (the HF folder the GGUF
    loader writes, written here first if missing): name -> folder."""
    from cluster.config import smollm2_gguf_path
    from cluster.model.loader import gguf_cache_dir, iter_weights, load_hf_config

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    gguf = smollm2_gguf_path()
    if not (gguf_cache_dir(gguf) / "model.safetensors").is_file():
        for _ in iter_weights(gguf, load_hf_config(gguf)):  # dequantizes once, writing the folder
            pass
    sys.path.insert(0, str(ROOT / "tests"))
    from lora_cases import make_adapters

    return make_adapters(str(gguf_cache_dir(gguf)), root / "adapters")


def chaos_deploy(out: Path, port: int, adapters: dict[str, str]) -> Path:
    """deploy.yaml's app with two engine copies, two ingress replicas, LoRA and a temporary store."""
    cfg = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    cfg["http_options"]["port"] = port
    cfg["applications"][0]["args"].update(
        engine_replicas=2, ingress_replicas=2, enable_lora=True, max_loras=2, lora_modules=adapters,
        response_store={"directory": str(out.parent / "store")}, step_timeout_s=STEP_TIMEOUT_S, **SMALL)
    out.write_text(yaml.safe_dump(cfg))
    return out


def start(args, tmp: Path) -> tuple[subprocess.Popen, str, str, Path]:
    """serve_cli on a chaos deploy file (its ports free ones): (process, base URL, dashboard, log)."""
    port = args.port or loopback_port()
    adapters = make_lora_adapters(tmp)
    env = {"LLM_CLUSTER_METRICS_PORT": str(loopback_port()), "RAY_SERVE_HAPROXY_STATS_PORT": str(loopback_port()),
           "RAY_SERVE_HAPROXY_METRICS_PORT": str(loopback_port())}
    log = tmp / "serve.log"
    proc = start_server(str(chaos_deploy(tmp / "deploy.yaml", port, adapters)), port, env=env, log=log)
    dashboard = re.search(r"dashboard (http://\S+?),", log.read_text()).group(1)
    return proc, f"http://127.0.0.1:{port}", dashboard, log


def stop(proc: subprocess.Popen) -> int:
    """SIGTERM to serve_cli (it drains, then stops Ray and sweeps its session); its exit status."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(180)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait(30)


# ---- the server's processes -------------------------------------------------------------------------
SEEN: dict[tuple[int, float], str] = {}  # (pid, create time) -> title, of every process of the tree seen


def title(p: psutil.Process) -> str:
    """A Ray process's title without the method it runs (ray::WorkerActor.execute), else its name."""
    cmd = p.cmdline()
    return cmd[0].split(" ")[0].split(".")[0] if cmd and cmd[0].startswith("ray::") else p.name()


def tree(pid: int) -> list[tuple[psutil.Process, str]]:
    """serve_cli's process tree with each process's title (remembered in SEEN)."""
    root = psutil.Process(pid)
    out = []
    for p in [root, *root.children(recursive=True)]:
        try:
            t = title(p)
            SEEN[p.pid, p.create_time()] = t
            out.append((p, t))
        except psutil.Error:
            continue
    return out


def components(pid: int, app: str) -> dict[str, list[psutil.Process]]:
    """The processes of each kind of COMPONENTS in the tree."""
    titles = {COMPONENTS[k].format(app=app): k for k in COMPONENTS}
    found: dict[str, list[psutil.Process]] = {k: [] for k in COMPONENTS}
    for p, t in tree(pid):
        if t in titles:
            found[titles[t]].append(p)
    return found


# ---- Serve's view (REST API on the dashboard) -----------------------------------------------------------
def serve_apps(dashboard: str) -> dict:
    r = requests.get(f"{dashboard}/api/serve/applications/", timeout=10)
    r.raise_for_status()
    return r.json()


def find_app(dashboard: str) -> str:
    """The application serving the model: the one with `engine` and `ingress` deployments."""
    apps = serve_apps(dashboard)["applications"]
    return next(name for name, a in apps.items() if {"engine", "ingress"} <= set(a["deployments"]))


def replica_states(dashboard: str, app: str) -> tuple[str, dict[str, dict[str, int]], list[str]]:
    """(app status, {deployment: {state: count}}, the proxies' statuses)."""
    d = serve_apps(dashboard)
    a = d["applications"][app]
    states = {name: dict(Counter(r["state"] for r in dep["replicas"])) for name, dep in a["deployments"].items()}
    return a["status"], states, [p["status"] for p in d.get("proxies", {}).values()]


def engine_replicas(dashboard: str, app: str) -> list[str]:
    reps = serve_apps(dashboard)["applications"][app]["deployments"]["engine"]["replicas"]
    return sorted(r["replica_id"] for r in reps if r["state"] == "RUNNING")


@dataclass
class Baseline:
    """The server as it started, which every recovery must come back to."""
    app: str
    replicas: dict[str, dict[str, int]]
    processes: dict[str, int]


def as_started(base: str, dashboard: str, pid: int, baseline: Baseline) -> str | None:
    """None when the server is as it started, else what differs."""
    try:
        if (status := requests.get(f"{base}/health", timeout=5).status_code) != 200:
            return f"/health {status}"
        app_status, states, proxies = replica_states(dashboard, baseline.app)
    except (requests.RequestException, ValueError, KeyError) as exc:
        return f"not answering: {type(exc).__name__}"
    if app_status != "RUNNING" or states != baseline.replicas or any(s != "HEALTHY" for s in proxies):
        return f"Serve: app {app_status}, replicas {states}, proxies {proxies}"
    counts = {k: len(v) for k, v in components(pid, baseline.app).items()}
    if fixed_counts(counts) == fixed_counts(baseline.processes) and all(
            counts[k] <= counts["engine"] for k in LAZY_KINDS):
        return None
    return f"processes {counts} (at the start {baseline.processes})"


def fixed_counts(counts: dict[str, int]) -> dict[str, int]:
    """The counts of the kinds started with the server (a lazy kind may be 0 or 1 per copy)."""
    return {k: n for k, n in counts.items() if k not in LAZY_KINDS}


def wait_as_started(base: str, dashboard: str, pid: int, baseline: Baseline, timeout_s: float) -> str | None:
    """Until the server is as it started twice in a row, 1 s apart; None then, else the last difference."""
    deadline, streak, why = time.monotonic() + timeout_s, 0, "not checked"
    while time.monotonic() < deadline:
        why = as_started(base, dashboard, pid, baseline)
        streak = streak + 1 if why is None else 0
        if streak >= 2:
            return None
        time.sleep(1)
    return why


# ---- the kills ---------------------------------------------------------------------------------------
@dataclass
class Kill:
    kind: str
    pid: int
    t: float  # seconds since the start of the traffic
    copy_pid: int | None = None  # a worker's or compiler's engine copy (its restart)
    recovered_s: float | None = None  # from the kill until the server was as it started
    restart: str | None = None  # what was done because it did not come back by itself
    never: str | None = None  # what was still missing when the run gave up on it

    def window_end(self) -> float:
        return self.t + (self.recovered_s if self.recovered_s is not None else float("inf"))


def engine_copy_of(dashboard: str, app: str, pid: int) -> int | None:
    """The pid of the engine copy whose namespace holds the actor in process `pid` (state API)."""
    try:
        r = requests.get(f"{dashboard}/api/v0/actors", params={"limit": 10000, "detail": 1}, timeout=10)
        actors = r.json()["data"]["result"]["result"]
        ns = next(a["ray_namespace"] for a in actors if a.get("pid") == pid and a["state"] == "ALIVE")
        name = f"SERVE_REPLICA::{app}#engine#{ns.removeprefix('engine-')}"
        return next(a["pid"] for a in actors if a.get("name") == name and a["state"] == "ALIVE")
    except (requests.RequestException, ValueError, KeyError, StopIteration):
        return None


def restart(kill: Kill, dashboard: str, pid: int, app: str) -> str:
    """Bring back what did not come back by itself; says what was done."""
    found = components(pid, app)
    if kill.kind in ("worker", "grammar") and kill.copy_pid and psutil.pid_exists(kill.copy_pid):
        os.kill(kill.copy_pid, signal.SIGKILL)
        return f"killed its engine copy (pid {kill.copy_pid}): Serve starts a fresh one"
    if kill.kind == "haproxy":
        managers = [p for p, t in tree(pid) if t == "ray::HAProxyManager"]
        for p in managers:
            p.kill()
        return f"killed Serve's HAProxyManager {[p.pid for p in managers]}: the controller starts another"
    if kill.kind == "controller" or not found["controller"]:
        d = serve_apps(dashboard)
        config = {"proxy_location": d["proxy_location"], "applications": [a["deployed_app_config"]
                                                                           for a in d["applications"].values()],
                  "http_options": {k: d["http_options"][k] for k in ("host", "port")}}
        requests.put(f"{dashboard}/api/serve/applications/", json=config, timeout=60).raise_for_status()
        return "deployed the app again through Serve's REST API"
    for p in found["controller"]:
        p.kill()
    return "killed Serve's controller: Ray restarts it and it reconciles the replicas"


class Killer(threading.Thread):
    """SIGKILLs one component every --kill-every-s to twice that, each kind in turn in a random
    order, and waits for the server to be as it started after each (restarting what does not
    come back by itself). Sets `stop` when something never comes back."""

    def __init__(self, args, base: str, dashboard: str, pid: int, baseline: Baseline, t0: float,
                 stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.args, self.base, self.dashboard, self.pid, self.baseline = args, base, dashboard, pid, baseline
        self.t0, self.stop, self.rng = t0, stop, random.Random(args.seed)
        self.kills: list[Kill] = []
        self.problems: list[str] = []

    def kinds(self):
        while True:
            yield from self.rng.sample(list(COMPONENTS), len(COMPONENTS))

    def run(self) -> None:
        next_t = time.monotonic() + self.rng.uniform(self.args.kill_every_s, 2 * self.args.kill_every_s)
        for kind in self.kinds():
            if self.stop.wait(max(0.0, next_t - time.monotonic())):
                return
            if kind in LAZY_KINDS and not components(self.pid, self.baseline.app)[kind]:
                continue  # no copy has started one yet: the next kind now
            kill = self.kill(kind)
            if kill is None or kill.never:
                self.stop.set()  # the server is not whole: the run ends here
                return
            next_t = max(time.monotonic() + 10,
                         kill.t + self.t0 + self.rng.uniform(self.args.kill_every_s, 2 * self.args.kill_every_s))

    def kill(self, kind: str) -> Kill | None:
        victims = components(self.pid, self.baseline.app)[kind]
        if not victims:
            self.problems.append(f"no {kind} process to kill")
            return None
        victim = self.rng.choice(victims)
        copy_pid = engine_copy_of(self.dashboard, self.baseline.app, victim.pid) if kind in ("worker", "grammar") else None
        victim.kill()
        kill = Kill(kind, victim.pid, time.monotonic() - self.t0, copy_pid)
        self.kills.append(kill)
        print(f"{kill.t / 60:6.1f} min  killed {kind} (pid {victim.pid})", flush=True)
        self.recover(kill)
        return kill

    def recover(self, kill: Kill) -> None:
        wait = self.args.recover_s
        why = wait_as_started(self.base, self.dashboard, self.pid, self.baseline, wait)
        if why is not None:
            try:
                action = restart(kill, self.dashboard, self.pid, self.baseline.app)
            except (requests.RequestException, psutil.Error, OSError, ValueError, KeyError) as exc:
                action = f"the restart failed: {exc!r}"
            kill.restart = f"not back after {wait:g} s ({why}): {action}"
            print(f"         {kill.kind}: {kill.restart}", flush=True)
            why = wait_as_started(self.base, self.dashboard, self.pid, self.baseline, wait)
        if why is not None:
            kill.never = why
            self.problems.append(f"{kill.kind} (pid {kill.pid}) never came back: {why}")
            print(f"         {kill.kind} never came back: {why}", flush=True)
            return
        kill.recovered_s = time.monotonic() - self.t0 - kill.t
        print(f"         {kill.kind}: as started again after {kill.recovered_s:.1f} s", flush=True)


# ---- the workload -----------------------------------------------------------------------------------
def run_lora(base, model, rng):
    """Chat or a stream on one of the LoRA adapters (the adapter as `model`)."""
    runner = soak.run_stream if rng.random() < 0.5 else soak.run_chat
    return runner(base, rng.choice(ADAPTERS), rng)


def _respond(base: str, model: str, rng: random.Random, **extra) -> requests.Response:
    body = {"model": model, "input": soak.copy_prompt(rng), "max_output_tokens": 32, **extra}
    return requests.post(f"{base}/v1/responses", json=body, timeout=soak.TIMEOUT_S)


def run_response_chain(base, model, rng):
    """A response continued with `previous_response_id`: one stored just before, or (half of the
    time, once there are some) one stored earlier in the run, perhaps before a store restart."""
    if STORED and rng.random() < 0.5:
        previous = rng.choice(STORED)
    else:
        first = _respond(base, model, rng, store=True)
        if first.status_code != 200:
            return soak.http_problem(first)
        previous = first.json()["id"]
        STORED.append(previous)
        del STORED[:-200]
    r = _respond(base, model, rng, previous_response_id=previous, store=rng.random() < 0.5)
    if r.status_code != 200:
        return soak.http_problem(r)
    answer = r.json()
    ok = answer["status"] in ("completed", "incomplete") and answer["previous_response_id"] == previous
    return soak.expect(ok, f"{r.status_code} {r.text[:200]}")


RUNNERS = {**soak.RUNNERS, "lora": run_lora, "response_chain": run_response_chain}


@dataclass
class Record:
    kind: str
    t0: float  # seconds since the start of the traffic
    t1: float
    problem: str | None  # None: as expected
    status: int | None = None
    error: dict | None = None
    failure: str | None = None  # "cut", "refused", "timeout", "malformed": how it failed, if it did


def failure_of(exc: Exception) -> str:
    """How a request that raised failed: refused (no connection), cut, timeout, or malformed."""
    if isinstance(exc, requests.ConnectTimeout):
        return "refused"
    if isinstance(exc, requests.Timeout):
        return "timeout"
    if isinstance(exc, requests.ConnectionError):
        return "refused" if "refused" in str(exc) or "NewConnectionError" in repr(exc) else "cut"
    if isinstance(exc, requests.exceptions.ChunkedEncodingError):
        return "cut"
    return "malformed"


def one(kind: str, base: str, model: str, rng: random.Random, t0: float) -> Record:
    start = time.monotonic() - t0
    try:
        problem = RUNNERS[kind](base, model, rng)
        failure = "cut" if getattr(problem, "cut", False) else None
    except Exception as exc:
        problem, failure = repr(exc)[:400], failure_of(exc)
    return Record(kind, start, time.monotonic() - t0, None if problem is None else str(problem)[:400],
                  getattr(problem, "status", None), getattr(problem, "error", None), failure)


def client(base: str, model: str, seed: int, t0: float, stop: threading.Event, records: list,
           current: dict) -> None:
    rng = random.Random(seed)
    mix = {k: w for k, w in MIX.items() if k != "lora" or ADAPTERS}
    kinds, weights = zip(*mix.items())
    while not stop.is_set():
        kind = rng.choices(kinds, weights)[0]
        current[seed] = (kind, time.monotonic() - t0)
        record = one(kind, base, model, rng, t0)
        records.append(record)
        current.pop(seed, None)
        if record.failure == "refused":  # nothing listens: wait a little, as a client would
            time.sleep(1.0)
        elif record.problem is not None:
            time.sleep(0.2)


# ---- sorting the outcomes ------------------------------------------------------------------------------
def outcome(rec: Record, kills: list[Kill], deadline_s: float) -> tuple[str, str]:
    """(finished | error | cut | refused | lost, what: the error's kind, the kill it is put down
    to, or why it is a loss)."""
    if rec.t1 - rec.t0 > deadline_s or rec.failure == "timeout":
        return "lost", f"no answer within {deadline_s:g} s ({rec.t1 - rec.t0:.0f} s): {rec.problem}"
    if rec.failure in ("cut", "refused"):
        culprit = cut_by(rec, kills)
        return (rec.failure, culprit) if culprit else ("lost", f"{rec.failure} with no ingress or HAProxy kill "
                                                               f"around it: {rec.problem}")
    if rec.problem is None:
        return "finished", ""
    if status_of(rec) in ERROR_STATUSES and rec.error and rec.error.get("message"):
        return "error", error_kind(rec)
    return "lost", rec.problem


def cut_by(rec: Record, kills: list[Kill]) -> str | None:
    """The kill a cut or refused request is put down to: an ingress replica's or HAProxy's that it
    was in flight around (a refusal: while HAProxy was down, until the server recovered)."""
    for k in kills:
        if rec.failure == "refused":
            if k.kind == "haproxy" and k.t - 1 <= rec.t0 <= k.window_end() + CUT_GRACE_S:
                return k.kind
        elif k.kind in CUT_KINDS and rec.t0 <= k.t + CUT_GRACE_S and rec.t1 >= k.t - 1:
            return k.kind
    return None


def status_of(rec: Record) -> int | None:
    """The HTTP status of a failed answer; for an error event in a stream (sent with 200), its code."""
    code = (rec.error or {}).get("code")
    return code if rec.status == 200 and isinstance(code, int) else rec.status


def error_kind(rec: Record) -> str:
    """`status type: message` (`event` for an error event in a stream), ids and numbers taken out
    so that alike errors count together."""
    message = re.sub(r"\b[0-9a-f]{8,}\b|\d+(\.\d+)?", "#", rec.error["message"])[:90]
    where = "event" if rec.status == 200 else "answer"
    return f"{status_of(rec)} {where} {rec.error.get('type')}: {message}"


def near(rec: Record, kills: list[Kill]) -> str:
    """The kinds of the kills whose time, to their recovery, overlaps the request."""
    kinds = sorted({k.kind for k in kills if rec.t0 <= k.window_end() + CUT_GRACE_S and rec.t1 >= k.t - CUT_GRACE_S})
    return "+".join(kinds) or "none"


# ---- the end ------------------------------------------------------------------------------------------
def copy_stats(base: str, replicas: list[str], timeout_s: float = 60) -> dict[str, dict]:
    """Each engine copy's /engine/stats by replica id (it answers from one copy at a time, so it is
    asked until every copy has answered)."""
    seen, deadline = {}, time.monotonic() + timeout_s
    while set(replicas) - set(seen) and time.monotonic() < deadline:
        stats = requests.get(f"{base}/engine/stats", timeout=30).json()
        seen[stats["replica"]] = stats
    return seen


def kv_left(base: str, dashboard: str, app: str, timeout_s: float = 120) -> dict[str, dict]:
    """Until every engine copy holds no request and no block (or `timeout_s`): per copy, the
    blocks in use, the blocks, the requests unfinished."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = copy_stats(base, engine_replicas(dashboard, app))
        left = {r: {"blocks_in_use": s["num_blocks"] - s["num_free_blocks"], "blocks": s["num_blocks"],
                    "unfinished": s["num_unfinished"]} for r, s in stats.items()}
        idle = all(v["blocks_in_use"] == 0 and v["unfinished"] == 0 for v in left.values())
        if idle or time.monotonic() > deadline:
            if set(engine_replicas(dashboard, app)) - set(left):
                raise ValueError(f"an engine copy did not answer /engine/stats (got {sorted(left)})")
            return left
        time.sleep(1)


def orphans(sessions: set[int], wait_s: float = 10) -> list[str]:
    """Processes left of the server's sessions, or of its tree as seen during the run, once
    `wait_s` has passed."""
    deadline = time.monotonic() + wait_s
    while True:
        left = []
        for p in psutil.process_iter():
            try:
                if (p.pid, p.create_time()) in SEEN or os.getsid(p.pid) in sessions:
                    if p.status() != psutil.STATUS_ZOMBIE:
                        left.append(f"pid {p.pid} {SEEN.get((p.pid, p.create_time())) or p.name()}")
            except (psutil.Error, OSError):
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.5)


def pss_mb(pid: int) -> float:
    tree(pid)  # remembers the processes seen
    return sum(soak.sample_tree(pid)[0].values())


# ---- the run ------------------------------------------------------------------------------------------
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=20)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--kill-every-s", type=float, default=30, help="a kill every this to twice this (seconds)")
    ap.add_argument("--deadline-s", type=float, default=120, help="a request not answered by then is lost")
    ap.add_argument("--recover-s", type=float, default=180,
                    help="how long a component has to come back by itself, then again after its restart")
    # Measured on the 2-core VM: 7.4-8.1 GB in 4-7 minute runs with kills (a worker ~1.9 GB, its
    # 1 GiB KV cache included). Over longer runs a worker grows to 2.2-2.9 GB and a grammar compiler
    # to 0.65 GB before levelling off (docs/benchmarks.md, "Soak"): ~9.5 GB for two copies.
    ap.add_argument("--max-pss-mb", type=float, default=11000, help="peak PSS of serve_cli's process tree")
    ap.add_argument("--sample-every-s", type=float, default=15)
    ap.add_argument("--url", help="a running server (default: start serve_cli on a chaos deploy file)")
    ap.add_argument("--pid", type=int, help="with --url: serve_cli's pid, whose process tree holds the components")
    ap.add_argument("--dashboard", default="http://127.0.0.1:8265", help="with --url: the Ray dashboard")
    ap.add_argument("--port", type=int, default=0, help="the started server's HTTP port (default: a free one)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.url and args.pid is None:
        ap.error("--url needs --pid (serve_cli's process id): the components are found in its process tree")
    soak.TIMEOUT_S = args.deadline_s

    proc, log = None, None
    if args.url:
        base, dashboard, pid = args.url.rstrip("/"), args.dashboard.rstrip("/"), args.pid
    else:
        tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
        proc, base, dashboard, log = start(args, tmp)
        pid = proc.pid
        print(f"chaos: serve_cli pid {pid} at {base}, dashboard {dashboard}, log {log}", flush=True)
    try:
        return chaos(args, base, dashboard, pid, proc, log)
    finally:
        if proc is not None and proc.poll() is None:
            stop(proc)


def baseline_of(base: str, dashboard: str, pid: int) -> Baseline:
    """The server once it has settled: its replicas and processes (what recoveries come back to)."""
    app = find_app(dashboard)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        status, states, proxies = replica_states(dashboard, app)
        if status == "RUNNING" and all(set(s) == {"RUNNING"} for s in states.values()):
            baseline = Baseline(app, states, {k: len(v) for k, v in components(pid, app).items()})
            if wait_as_started(base, dashboard, pid, baseline, 30) is None:
                return baseline
        time.sleep(2)
    raise SystemExit("the server did not settle in 5 minutes")


def chaos(args, base: str, dashboard: str, pid: int, proc: subprocess.Popen | None, log: Path | None) -> int:
    baseline = baseline_of(base, dashboard, pid)
    models = requests.get(f"{base}/v1/models", timeout=30).json()["data"]
    model = next(m["id"] for m in models if not m.get("parent"))
    ADAPTERS[:] = [m["id"] for m in models if m.get("parent") == model]
    sessions = {os.getsid(p.pid) for p, _ in tree(pid)}
    print(f"chaos: {args.concurrency} clients for {args.minutes:g} min; {model}, adapters {ADAPTERS}; "
          f"processes {baseline.processes}", flush=True)

    done, records, current = threading.Event(), [], {}
    t0 = time.monotonic()
    clients = [threading.Thread(target=client, args=(base, model, args.seed + i, t0, done, records, current),
                                daemon=True) for i in range(args.concurrency)]
    killer = Killer(args, base, dashboard, pid, baseline, t0, threading.Event())
    for t in [*clients, killer]:
        t.start()
    peak = 0.0
    while (elapsed := time.monotonic() - t0) < args.minutes * 60 and not killer.stop.is_set():
        peak = max(peak, pss := pss_mb(pid))
        print(f"{elapsed / 60:6.1f} min  PSS {pss:8.0f} MB  requests {len(records):6d}  "
              f"kills {len(killer.kills)}", flush=True)
        killer.stop.wait(max(0.0, min(args.sample_every_s, args.minutes * 60 - elapsed)))
    done.set()
    killer.stop.set()
    for t in clients:
        t.join(max(1.0, t0 + elapsed + args.deadline_s + 30 - time.monotonic()))
    killer.join(2 * args.recover_s + 60)  # a recovery under way finishes
    hung = [Record(kind, start, time.monotonic() - t0, "still waiting at the end", failure="timeout")
            for kind, start in list(current.values())]
    peak = max(peak, pss_mb(pid))
    end = {"kv": {}, "problems": []}
    try:
        end["kv"] = kv_left(base, dashboard, baseline.app)
    except (requests.RequestException, ValueError, KeyError) as exc:
        end["problems"].append(f"the engine copies' stats could not be read: {exc!r}")
    if proc is not None:
        end["serve_cli_status"] = stop(proc)
        end["orphans"] = orphans(sessions)
    return report(args, records + hung, killer, end, peak, log)


def report(args, records: list[Record], killer: Killer, end: dict, peak: float, log: Path | None) -> int:
    kills = killer.kills
    sorted_out = [(r, *outcome(r, kills, args.deadline_s)) for r in records]
    counts = Counter(o for _, o, _ in sorted_out)
    errors = Counter(f"{what} [kill around: {near(r, kills)}]" for r, o, what in sorted_out if o == "error")
    cut = Counter(f"{o} around a kill of {what}" for _, o, what in sorted_out if o in ("cut", "refused"))
    lost = [(r, what) for r, o, what in sorted_out if o == "lost"]
    by_kind = {k: [x for x in kills if x.kind == k] for k in COMPONENTS}
    in_flight = [dict(Counter(o for r, o, _ in sorted_out if r.t0 <= k.t <= r.t1)) for k in kills]
    kv_blocks = sum(v["blocks_in_use"] for v in end["kv"].values())
    unfinished = sum(v["unfinished"] for v in end["kv"].values())

    print("\nkills (kind: killed, back by themselves, restarts needed, time to recover):")
    for k, ks in by_kind.items():
        times = [x.recovered_s for x in ks if x.recovered_s is not None]
        span = f"{min(times):.0f}-{max(times):.0f} s" if times else "-"
        print(f"  {k:10s} {len(ks):3d}  {sum(x.recovered_s is not None and not x.restart for x in ks):3d}  "
              f"{sum(bool(x.restart) for x in ks):3d}  {span}")
    print(f"requests: sent {len(records)}, finished {counts['finished']}, failed with an error {counts['error']}, "
          f"cut in flight {counts['cut']}, refused while HAProxy was down {counts['refused']}, "
          f"lost {counts['lost']}")
    by_request_kind = Counter((r.kind, o) for r, o, _ in sorted_out)
    print("  by kind (finished/error/cut/refused/lost): " + ", ".join(
        f"{k} " + "/".join(str(by_request_kind[k, o]) for o in ("finished", "error", "cut", "refused", "lost"))
        for k in MIX))
    print("  in flight at each kill: " + "; ".join(
        f"{k.kind} at {k.t:.0f} s: {dict(sorted(f.items())) or '-'}" for k, f in zip(kills, in_flight)))
    for what, n in errors.most_common():
        print(f"  error x{n}: {what}")
    for what, n in cut.items():
        print(f"  {what}: {n}")
    for r, what in lost[:20]:
        print(f"  LOST {r.kind} at {r.t0:.1f}-{r.t1:.1f} s (kill around: {near(r, kills)}): {what[:300]}")
    print(f"KV blocks left: {kv_blocks}, requests unfinished: {unfinished} ({end['kv']})")
    if "orphans" in end:
        print(f"serve_cli exit status {end['serve_cli_status']}; processes left after it stopped: "
              f"{len(end['orphans'])} {end['orphans'][:10]}")
    print(f"peak PSS of the tree: {peak:.0f} MB (limit {args.max_pss_mb:g})")

    problems = killer.problems + end["problems"]
    if lost:
        problems.append(f"{len(lost)} requests lost")
    if kv_blocks or unfinished:
        problems.append(f"{kv_blocks} KV blocks and {unfinished} requests left on the engine copies")
    if end.get("orphans"):
        problems.append(f"{len(end['orphans'])} processes left after serve_cli stopped")
    if peak > args.max_pss_mb:
        problems.append(f"peak PSS {peak:.0f} MB over {args.max_pss_mb:g} MB")
    if not kills:
        problems.append("nothing was killed (a run too short for --kill-every-s)")
    print("FAIL: " + "; ".join(problems) if problems else "PASS", flush=True)
    if log is not None:
        print(f"server log: {log}")
    if args.json:
        figures = {"minutes": args.minutes, "concurrency": args.concurrency, "kill_every_s": args.kill_every_s,
                   "kills": [{**asdict(k), "in_flight": f} for k, f in zip(kills, in_flight)],
                   "kills_by_kind": {k: {"killed": len(ks), "restarts": sum(bool(x.restart) for x in ks),
                                         "recovered_s": [x.recovered_s for x in ks]} for k, ks in by_kind.items()},
                   "requests": {"sent": len(records), **{o: counts[o] for o in ("finished", "error", "cut", "refused",
                                                                                 "lost")}},
                   "requests_by_kind": {f"{k}:{o}": n for (k, o), n in by_request_kind.items()},
                   "errors_by_kind": dict(errors), "cut_by_kill": dict(cut),
                   "lost": [{**asdict(r), "why": what} for r, what in lost],
                   "kv_left": end["kv"], "kv_blocks_left": kv_blocks, "orphans": end.get("orphans"),
                   "serve_cli_status": end.get("serve_cli_status"), "peak_pss_mb": peak,
                   "max_pss_mb": args.max_pss_mb, "problems": problems}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
