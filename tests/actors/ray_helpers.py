"""Helpers for tests that start Ray: loopback only, every process stopped by pid."""
import os
import signal
import subprocess
import time
from pathlib import Path

from actors.env import apply_loopback_env, loopback_port

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A free port outside the kernel's ephemeral range (a port-0 pick raced Ray's own binds:
    HAProxy once found its port taken by a process of the starting cluster)."""
    return loopback_port()


def loopback_env(**extra: str) -> dict[str, str]:
    """The environment of a test's server: loopback, no cluster named, HAProxy's stats and
    Prometheus listeners and Serve's fallback proxy on free ports (Ray fixes them at 8404, 9101
    and 8500, so a server still stopping, or one outside the tests, would refuse the next one),
    a short stop grace, and no Ray dashboard."""
    env = apply_loopback_env(dict(os.environ))
    env.pop("RAY_ADDRESS", None)
    env.setdefault("RAY_SERVE_HAPROXY_STATS_PORT", str(free_port()))
    env.setdefault("RAY_SERVE_HAPROXY_METRICS_PORT", str(free_port()))
    env.setdefault("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", str(free_port()))
    # A test's server stops with nothing to keep: its session's stragglers (Ray's daemons, Serve's
    # actors, which outwait any grace) get SIGKILL after 0.5 s instead of 2 (~20 stops a run).
    env.setdefault("LLM_CLUSTER_STOP_GRACE_S", "0.5")
    # No Ray dashboard modules (their processes cost ~2 CPU-s a server start) unless a test
    # reads the state API or stops and restarts a server as `make serve` runs it (then "1").
    env.setdefault("LLM_CLUSTER_RAY_DASHBOARD", "0")
    env.update(extra)
    return env


def http_status(url: str) -> int | None:
    """The status of a GET, or None if nothing answers."""
    import requests

    try:
        return requests.get(url, timeout=5).status_code
    except requests.RequestException:
        return None


def stop_process(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """SIGTERM (serve_cli shuts its local Ray down on it), then SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


# Serve retries a failing replica constructor for long; these lines mean it will not come up.
FATAL = ("the replica will be stopped", "Deploying app 'llm' failed")


def wait_for(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log else ""
            raise RuntimeError(f"process exited ({proc.returncode}) while waiting for {what}:\n{tail}")
        text = log.read_text() if log else ""
        if any(f in text for f in FATAL):
            start = min(text.index(f) for f in FATAL if f in text)
            raise RuntimeError(f"the app failed while waiting for {what}:\n{text[max(0, start - 2000):start + 4000]}")
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    tail = log.read_text()[-4000:] if log else ""
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n{tail}")


def fuzz_openapi(base: str, tmp_path: Path, header: str, max_examples: int, seed: int,
                 *extra: str, timeout: float = 900) -> int:
    """schemathesis (`st run`) over `base`/openapi.json: no 5xx and no status the schema does not
    document (tests/fixtures/schemathesis_hooks.py caps generation at a few tokens). Asserts the run
    passed every case it generated; returns how many it generated. `extra`: more `st run` flags."""
    import re
    import sys

    env = loopback_env(SCHEMATHESIS_HOOKS="schemathesis_hooks", PYTHONPATH=str(ROOT / "tests" / "fixtures"))
    cmd = [str(Path(sys.executable).parent / "st"), "run", base + "/openapi.json", *extra,
           "--checks", "not_a_server_error,status_code_conformance", "-H", header,
           "--phases", "examples,fuzzing", "--max-examples", str(max_examples), "--workers", "1", "--seed", str(seed),
           "--request-timeout", "120", "--suppress-health-check", "all", "--generation-database", "none",
           "--no-color", "--report-dir", str(tmp_path)]
    done = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    print(done.stdout[-3000:])  # the summary, for -s runs
    generated = re.search(r"(\d+) generated, (\d+) passed", done.stdout)
    assert generated and generated.group(1) == generated.group(2), done.stdout[-3000:]
    return int(generated.group(1))
