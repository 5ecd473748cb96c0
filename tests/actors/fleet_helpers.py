"""Helpers for the scale-out tests: a Serve app subprocess, a cluster probe, OpenAI calls."""
import atexit
import json
import queue
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests
import yaml

from ray_helpers import ROOT, loopback_env, wait_for

PROBE = Path(__file__).resolve().parent / "fleet_probe.py"
FIXTURES = ROOT / "tests" / "fixtures"
# Logical CPUs are a budget, not cores: small reservations let several engine copies share a
# 2-core test machine.
SMALL = {"engine_num_cpus": 0.05, "worker_num_cpus": 0.1, "ingress_num_cpus": 0.05, "worker_torch_threads": 1}
# Serve replaces a failed engine copy after 3 failed health checks in a row: 1 s apart here
# instead of the default 5 s, so the tests that fail a copy wait ~3 s for that, not ~15 s.
FAST_HEALTH_CHECKS = {"engine_health_check_period_s": 1}


def tiny_app(name: str, model_dir: str, **args) -> dict:
    """A Serve application entry: the tiny random model, served as `name`, at /name."""
    engine = dict(model=model_dir, served_model_name=name, dtype="float32", max_model_len=512,
                  num_kv_blocks=256, block_size=16, logits_processors=["dummy_logitsprocs:SlowStepProcessor"],
                  response_store={"enabled": False})  # no Responses API here: no store replica to start
    return {"name": name, "route_prefix": f"/{name}", "import_path": "actors.app:build_app",
            "runtime_env": {"env_vars": {"PYTHONPATH": str(FIXTURES)}},
            "args": {**engine, **SMALL, **FAST_HEALTH_CHECKS, **args}}


def write_deploy(path: Path, http_port: int, apps: list[dict]) -> Path:
    path.write_text(yaml.safe_dump({"proxy_location": "HeadOnly",
                                    "http_options": {"host": "127.0.0.1", "port": http_port},
                                    "applications": apps}))
    return path


def start_serve(deploy: Path, log: Path, **env: str) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(deploy)], cwd=ROOT,
                                env=loopback_env(**env), stdout=out, stderr=subprocess.STDOUT)


def gcs_address(log: Path) -> str:
    return wait_for(lambda: re.search(r"address (\S+:\d+),", log.read_text()), 30, "the GCS address").group(1)


class _Probe:
    """One fleet_probe.py driver attached to a cluster, asked one command at a time: a driver per
    question cost seconds of Python and Ray start-up, and the tests poll the cluster with it."""

    def __init__(self, gcs: str) -> None:
        self.stderr = tempfile.TemporaryFile(mode="w+")
        # PYTHONPATH: this checkout's `actors` (Serve unpickles the router class named in the config).
        self.proc = subprocess.Popen([sys.executable, str(PROBE), gcs, "--serve"], cwd=ROOT,
                                     env=loopback_env(PYTHONPATH=str(ROOT)), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True, bufsize=1)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def ask(self, args: tuple[str, ...], timeout: float):
        """The command's answer; RuntimeError if it failed, TimeoutExpired after `timeout` s."""
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise subprocess.TimeoutExpired([str(PROBE), *args], timeout) from None
            if line is None:
                self.stderr.seek(0)
                raise RuntimeError(f"fleet_probe exited ({self.proc.wait()}) at {args}:\n{self.stderr.read()[-3000:]}")
            if line.startswith("RESULT "):
                return json.loads(line[7:])
            if line.startswith("ERROR "):
                raise RuntimeError(f"fleet_probe {args} failed:\n{json.loads(line[6:])[-3000:]}")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # it detaches from the cluster and exits
                self.proc.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)
        self.stderr.close()


_probes: dict[str, _Probe] = {}


def probe(gcs: str, *args: str, timeout: float = 120):
    """The answer to one fleet_probe.py command on the cluster at `gcs`. The driver answering
    stays attached until close_probes(), which a fixture calls before it stops its cluster."""
    if gcs not in _probes:
        _probes[gcs] = _Probe(gcs)
    driver = _probes[gcs]
    try:
        return driver.ask(args, timeout)
    except subprocess.TimeoutExpired:
        _probes.pop(gcs).close()  # it may still answer this question: the next one gets a new driver
        raise
    finally:
        if driver.proc.poll() is not None and _probes.get(gcs) is driver:
            _probes.pop(gcs).close()


def close_probes() -> None:
    """Stop every probe driver (before its cluster stops: a driver whose GCS is gone lingers)."""
    while _probes:
        _probes.popitem()[1].close()


atexit.register(close_probes)


def wait_replicas(gcs: str, app: str, running: int, timeout: float, proc=None, log=None) -> dict:
    """Until APP's engine deployment has exactly `running` replicas RUNNING and none starting
    or stopping; returns the deployment's replica states."""
    def settled():
        states = probe(gcs, "status").get(app, {}).get("engine", {})
        return states if states == {"RUNNING": running} else None

    return wait_for(settled, timeout, f"{app}: {running} engine replicas running", proc, log)


def healthy(url: str) -> bool:
    try:
        return requests.get(url, timeout=5).status_code == 200
    except requests.RequestException:
        return False


def complete(base: str, model: str, prompt, timeout: float = 120, **body) -> requests.Response:
    return requests.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, **body}, timeout=timeout)


def stream_events(base: str, model: str, prompt, timeout: float = 300, started: threading.Event | None = None,
                  **body) -> list[dict | str]:
    """Every SSE event of a streamed completion: parsed JSON, or the literal "[DONE]". `started`
    is set once the first event has arrived."""
    events = []
    with requests.post(f"{base}/v1/completions", json={"model": model, "prompt": prompt, "stream": True, **body},
                       stream=True, timeout=timeout) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: "):
                data = line[6:].decode()
                events.append(data if data == "[DONE]" else json.loads(data))
                if started is not None:
                    started.set()
    return events


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series over every label set matching `labels`."""
    total = 0.0
    for m in re.finditer(rf"^{name}{{([^}}]*)}} (\S+)$", text, re.M):
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if all(have.get(k) == v for k, v in labels.items()):
            total += float(m.group(2))
    return total


def scrape(url: str) -> str:
    try:
        return requests.get(url, timeout=10).text
    except requests.RequestException:
        return ""

