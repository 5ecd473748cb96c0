"""Helpers for the scale-out tests: a Serve app subprocess, a cluster probe, OpenAI calls."""
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import requests
import yaml

from ray_helpers import ROOT, loopback_env, wait_for

PROBE = Path(__file__).resolve().parent / "fleet_probe.py"
FIXTURES = ROOT / "tests" / "fixtures"
# Logical CPUs are a budget, not cores: small reservations let several engine copies share a
# 2-core test machine.
SMALL = {"engine_num_cpus": 0.05, "worker_num_cpus": 0.1, "ingress_num_cpus": 0.05, "worker_torch_threads": 1}


def tiny_app(name: str, model_dir: str, **args) -> dict:
    """A Serve application entry: the tiny random model, served as `name`, at /name."""
    engine = dict(model=model_dir, served_model_name=name, dtype="float32", max_model_len=512,
                  num_kv_blocks=256, block_size=16, logits_processors=["dummy_logitsprocs:SlowStepProcessor"],
                  response_store={"enabled": False})  # no Responses API here: no store replica to start
    return {"name": name, "route_prefix": f"/{name}", "import_path": "actors.app:build_app",
            "runtime_env": {"env_vars": {"PYTHONPATH": str(FIXTURES)}}, "args": {**engine, **SMALL, **args}}


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


def probe(gcs: str, *args: str, timeout: float = 120):
    # PYTHONPATH: this checkout's `actors` (Serve unpickles the router class named in the config).
    done = subprocess.run([sys.executable, str(PROBE), gcs, *args], env=loopback_env(PYTHONPATH=str(ROOT)), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"fleet_probe {args} failed:\n{done.stderr[-3000:]}")
    return json.loads(next(line[7:] for line in done.stdout.splitlines() if line.startswith("RESULT ")))


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

