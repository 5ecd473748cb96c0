"""Stopping and starting `serve run` (actors/serve_cli.py, what `make serve` runs) as an operator
does, on one deploy file and one port:

1. a server answers; a second start on the same port is refused at once, naming the port and
   the process holding it (Serve's HAProxy);
2. SIGTERM while idle: it exits within 15 s, and no process of its session (Ray's daemons, the
   actors, HAProxy) and no listener on its ports is left;
3. a second server started right after answers a completion, and reads the prefix the first
   one computed back from the KV tier's disk folder (the same answer, its tokens counted cached);
4. SIGKILL of `serve run` itself: the server it ran still stops everything it started.
"""
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import requests
from fleet_helpers import start_serve, tiny_app, write_deploy
from ray_helpers import ROOT, free_port, http_status, loopback_env, stop_process, wait_for

MODEL = "tiny"


@pytest.fixture(scope="module")
def deploy(tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("restart")
    port, metrics_port = free_port(), free_port()
    app = tiny_app(MODEL, tiny_llama_dir, kv_offloading_disk_path=str(tmp / "kv"), kv_offloading_disk_size=0.05)
    path = write_deploy(tmp / "deploy.yaml", port, [app])
    return {"path": path, "port": port, "metrics_port": metrics_port, "tmp": tmp,
            "base": f"http://127.0.0.1:{port}/{MODEL}"}


def _start(deploy: dict, name: str) -> subprocess.Popen:
    log = deploy["tmp"] / f"{name}.log"
    # With Ray's dashboard, as `make serve` runs: its port too must be free again after a stop.
    proc = start_serve(deploy["path"], log, LLM_CLUSTER_METRICS_PORT=str(deploy["metrics_port"]),
                       LLM_CLUSTER_RAY_DASHBOARD="1")
    proc.log = log
    wait_for(lambda: http_status(f"{deploy['base']}/health") == 200, 600, f"{name} to be healthy", proc, log)
    return proc


def _complete(deploy: dict) -> str:
    r = requests.post(f"{deploy['base']}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0})
    r.raise_for_status()
    return r.json()["choices"][0]["finish_reason"]


LONG_PROMPT = list(range(100, 160))  # token ids: 3 full blocks of 16 the prefix cache may serve


def _complete_long(deploy: dict) -> tuple[str, int]:
    """(text, cached prompt tokens) of a greedy completion of LONG_PROMPT."""
    r = requests.post(f"{deploy['base']}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _session(proc: subprocess.Popen) -> list[psutil.Process]:
    """The server's session: the server (serve_cli's child) and every process it started, each
    with its name read as it was listed (`p.info["name"]`): short-lived helpers Ray runs may be
    gone by the time the list is read."""
    (server,) = psutil.Process(proc.pid).children()
    return [p for p in psutil.process_iter(["name"]) if _sid(p.pid) == server.pid]


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None


def _left(processes: list[psutil.Process]) -> list[str]:
    left = []
    for p in processes:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                left.append(f"{p.pid} {p.name()}")
        except psutil.Error:
            pass
    return left


def _listening(port: int) -> bool:
    return any(c.laddr.port == port and c.status == psutil.CONN_LISTEN for c in psutil.net_connections("tcp"))


def test_stop_while_idle_leaves_nothing_and_the_next_start_serves(deploy):
    first = _start(deploy, "first")
    try:
        assert _complete(deploy) == "length"
        text, cached = _complete_long(deploy)
        assert cached == 0
        # The blocks are written to the tier's folder in the background, right after their step.
        wait_for(lambda: len(list((deploy["tmp"] / "kv").rglob("*.kv"))) >= 3, 60, "the prompt's blocks in the KV tier")
        session = _session(first)
        names = " ".join(p.info["name"] or "" for p in session)
        assert "gcs_server" in names and "raylet" in names and "haproxy" in names, names

        # A second start on the same port: refused before anything starts, naming who holds it.
        second = subprocess.run([sys.executable, "-m", "actors.serve_cli", str(deploy["path"])], cwd=ROOT,
                                env=loopback_env(LLM_CLUSTER_METRICS_PORT=str(free_port())),
                                capture_output=True, text=True, timeout=60)
        assert second.returncode == 1
        assert f"port {deploy['port']} on 127.0.0.1 (http_options.port in {deploy['path']}) is already in use by pid" \
            in second.stderr and "haproxy" in second.stderr, second.stderr
        assert _complete(deploy) == "length"  # the running server is untouched

        t0 = time.monotonic()
        first.send_signal(signal.SIGTERM)
        assert first.wait(15) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 15
        assert _left(session) == []
        assert not _listening(deploy["port"]) and not _listening(deploy["metrics_port"])
        assert "Drained." in first.log.read_text()
    finally:
        stop_process(first)

    again = _start(deploy, "again")
    session = []
    try:
        assert _complete(deploy) == "length"
        assert _complete_long(deploy) == (text, 48)  # read back from the disk tier, not computed
        session = _session(again)
        again.send_signal(signal.SIGKILL)  # serve_cli itself, not the server it runs
        again.wait(10)
        wait_for(lambda: not _left(session), 60, "the killed serve_cli's server to stop what it started")
        assert not _listening(deploy["port"]) and not _listening(deploy["metrics_port"])
    finally:
        stop_process(again)
        for p in session:
            if _left([p]):
                p.kill()
