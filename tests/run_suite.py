"""`make test`: the whole suite as two pytest processes side by side, one per half of it.

- The tests marked `cluster` (the modules of `tests/actors/` that start a local Ray or a served
  app: all but those marked `no_cluster`, tests/actors/conftest.py) at normal priority, their
  output shown as they run. They spend much of their time waiting on other processes (Ray and
  Serve starting, health-check periods, control loops), which leaves the cores partly idle.
- Everything else (the engine's own tests and the HTTP layer's without a cluster: CPU-bound, no
  Ray) under `nice` with one torch thread, its output shown when it ends. The nice level gives
  the first half's timing-sensitive work (health checks, step timeouts, liveness pings, stop
  times) the CPU first; the single thread matters because a torch (OpenMP) thread descheduled by
  the other half stalls its partner at every barrier: with two threads the engine's tests ran
  many times slower beside the other half.

The served-app modules stay in one process, one after the other: two local Rays on one host
share ports Ray fixes (its dashboard agent's 52365; Serve's fallback proxy's 8500, which
`loopback_env` moves), and a server beside another was answered by the other's app.

Each half has its own --basetemp under one temporary folder (removed when both pass), and both
share its `shared/` for what they would otherwise each build (SmolLM2's HF reference). Arguments
are passed to both halves. Exit status: 0 when both pass, else the first failing half's.
SIGINT / SIGTERM: both halves get SIGINT (pytest then runs its fixtures' teardown, which stops
the servers they started), and are killed if they have not ended 60 s later.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NICE = 10


def _pytest(args: list[str], basetemp: Path) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={basetemp}", *args]


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _child(nice: int = 0):
    """What a half's process runs before pytest: SIGINT back to its default, which a shell's
    background job inherits as ignored (then Python installs no KeyboardInterrupt for it, and
    pytest would not run the teardown that stops its servers); then its nice level."""
    def setup() -> None:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.nice(nice)
        if nice:
            _nice_session(nice)
    return setup


def _nice_session(nice: int) -> None:
    """The same nice level for the process's session (its own: start_new_session). Under the
    kernel's autogroup scheduling (CONFIG_SCHED_AUTOGROUP, on by default on these VMs) the CPU is
    shared between sessions first and a process's nice level ranks it only within its own, so a
    niced half in its own session still took an even share from the servers the other half starts
    (each in a session of its own: actors/supervisor.py). Without autogroup there is no such file,
    or writing it fails: the process's own level is what counts then."""
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:
        pass


def main(args: list[str]) -> int:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with it ignored
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    root = Path(tempfile.mkdtemp(prefix="llm-cluster-tests-"))
    engine_log = root / "engine.log"
    os.environ["LLM_CLUSTER_TEST_SHARED_DIR"] = str(root / "shared")  # what both halves build once (tests/conftest.py)
    engine_env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(engine_log, "w") as out:
        # Each in its own session: a Ctrl-C reaches them through _stop, once, not twice.
        served = subprocess.Popen(_pytest(["tests/actors", "-m", "cluster", *args], root / "actors"), cwd=ROOT,
                                  start_new_session=True, preexec_fn=_child())
        engine = subprocess.Popen(_pytest(["tests", "-m", "not cluster", *args], root / "engine"), cwd=ROOT,
                                  env=engine_env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                  preexec_fn=_child(NICE))
    procs = [served, engine]
    try:
        codes = [p.wait() for p in procs]
    except BaseException:  # Ctrl-C, SIGTERM
        _stop(procs)
        print(f"\ninterrupted: both halves stopped; the niced half's output is in {engine_log}", flush=True)
        raise
    print(f"\n==== tests without a cluster (nice {NICE}, one torch thread) ====", flush=True)
    sys.stdout.write(engine_log.read_text())
    print(f"\n==== cluster tests: exit {codes[0]}; the rest: exit {codes[1]} ====", flush=True)
    failed = [c for c in codes if c != 0]
    if failed:
        print(f"pytest's folders kept under {root}", flush=True)
        return failed[0]
    shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:
        sys.exit(128 + signal.SIGINT)
