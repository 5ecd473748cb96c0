"""The outer process of `serve_cli` (what `make serve` runs): the server in a session of its own,
ended whole.

`supervise` checks the ports the server will listen on, starts the server (serve_cli again, with
`SERVER_ENV` set) as the leader of a new session, forwards stop signals to it and, once it has
exited, stops every process left in that session. Ray keeps its daemons, actor workers and
Serve's HAProxy in the session of the process that started the local Ray, so the session is the
whole server: nothing it started outlives it to hold a port the next start needs.

- SIGTERM / Ctrl-C: the first is forwarded (the server drains, then stops Serve and Ray); the
  second too (the server stops at once); a third stops the session with SIGKILL.
- The server dies with this process (PR_SET_PDEATHSIG): SIGKILL of `serve run` makes the server
  drain and stop, and sweep its own session (`sweep_session`).
- Signals sent to this process's group (a terminal's Ctrl-C, `kill -- -PGID`) reach only this
  process: the server is in another session, so Ray's daemons are not killed under the drain.

No Ray import here: the ports are checked and the session swept without it.
"""
from __future__ import annotations

import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import yaml

SERVER_ENV = "LLM_CLUSTER_SERVER_PROCESS"  # set: this process is the server, not the supervisor
PR_SET_PDEATHSIG = 1
# After the drain, the session's processes get SIGTERM, then this long, then SIGKILL. Ray's daemons
# and Serve's actors wait on a dying raylet past it (and are killed); our worker exits in ~1.5 s.
STOP_GRACE_ENV = "LLM_CLUSTER_STOP_GRACE_S"
DEFAULT_STOP_GRACE_S = 2.0
KILLED_GONE_S = 5.0  # SIGKILLed processes are gone in milliseconds; this bounds the wait for them


# ---- ports ------------------------------------------------------------------------------------
def http_listener(argv: list[str]) -> tuple[str, int, str]:
    """(host, port, where it was set) of the HTTP listener `serve run argv` will bind: the deploy
    file's http_options, else Serve's defaults (127.0.0.1:8000)."""
    host, port, origin = "127.0.0.1", 8000, "Serve's default port"
    config = next((a for a in argv if a.endswith((".yaml", ".yml"))), None)
    if config and Path(config).is_file():
        options = (yaml.safe_load(Path(config).read_text()) or {}).get("http_options") or {}
        host = options.get("host", host)
        if "port" in options:
            port, origin = int(options["port"]), f"http_options.port in {config}"
    return host, port, origin


def port_in_use(host: str, port: int) -> bool:
    """True if a listener already holds host:port (a bind fails with EADDRINUSE)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers bind: TIME_WAIT is no holder
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def port_holder(port: int) -> str:
    """Who listens on `port`: "pid N (name: command line)", or a note that it is not visible."""
    try:
        pids = {c.pid for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid}
    except psutil.AccessDenied:
        pids = set()
    described = []
    for pid in sorted(pids):
        try:
            p = psutil.Process(pid)
            described.append(f"pid {pid} ({p.name()}: {' '.join(p.cmdline())[:200]})")
        except psutil.Error:
            described.append(f"pid {pid}")
    return ", ".join(described) or "a process this user cannot see"


def check_ports(ports: list[tuple[str, int, str]]) -> None:
    """SystemExit naming the first (host, port, origin) already in use and who holds it."""
    for host, port, origin in ports:
        if port and port_in_use(host, port):
            raise SystemExit(f"serve_cli: port {port} on {host} ({origin}) is already in use by "
                             f"{port_holder(port)}. Stop that process, or choose another port.")


# ---- the session --------------------------------------------------------------------------------
def session_members(sid: int) -> list[psutil.Process]:
    """Every live process of session `sid` but the caller."""
    members = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                members.append(p)
        except (psutil.Error, ProcessLookupError, PermissionError):
            continue
    return members


def stop_grace_s() -> float:
    """Seconds between SIGTERM and SIGKILL when the session is swept: $LLM_CLUSTER_STOP_GRACE_S,
    else 2. Nothing of the server's state needs them (the drain has ended every request, the
    response store commits each write, the KV tier renames whole files); a shorter grace only
    stops sooner. SystemExit naming the variable for a value that is not a number >= 0."""
    value = os.environ.get(STOP_GRACE_ENV, DEFAULT_STOP_GRACE_S)
    try:
        seconds = float(value)
    except ValueError:
        raise SystemExit(f"${STOP_GRACE_ENV} must be a number of seconds, got {value!r}") from None
    if not seconds >= 0:
        raise SystemExit(f"${STOP_GRACE_ENV} must be >= 0, got {value!r}")
    return seconds


def sweep_session(sid: int, grace_s: float | None = None) -> int:
    """Stop every process of session `sid` (but the caller): SIGTERM, then SIGKILL to what is
    left after `grace_s` (default: stop_grace_s()). Returns how many there were."""
    grace_s = stop_grace_s() if grace_s is None else grace_s
    members = session_members(sid)
    _send(members, signal.SIGTERM)
    _send(_wait_gone(members, grace_s), signal.SIGKILL)
    _wait_gone(members, KILLED_GONE_S)
    return len(members)


def _send(procs: list[psutil.Process], signum: int) -> None:
    for p in procs:
        try:
            p.send_signal(signum)
        except psutil.Error:
            pass


def _wait_gone(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait until each process has exited (a zombie counts: its parent may be dead or be us);
    returns those still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        _reap_children()
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.05)


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _reap_children() -> None:
    """Collect exited children of ours (the server's: Ray's GCS and raylet) so none is left a zombie."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass
    except ChildProcessError:
        pass


def die_with_parent(signum: int = signal.SIGTERM) -> None:
    """Ask Linux to send `signum` to this process when its parent exits (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signum), 0, 0, 0)


# ---- the supervisor -------------------------------------------------------------------------------
def supervise(argv: list[str], ports: list[tuple[str, int, str]]) -> int:
    """Check `ports`, run `python -m actors.serve_cli argv` as the server in a new session,
    forward stop signals, sweep the session when it exits; the server's exit status."""
    stop_grace_s()  # a bad value fails here, before anything starts
    check_ports(ports)
    server = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", *argv], env={**os.environ, SERVER_ENV: "1"},
                              start_new_session=True, preexec_fn=die_with_parent)
    received = 0

    def forward(signum, frame) -> None:
        nonlocal received
        received += 1
        if received <= 2:  # the first drains, the second stops at once (serve_cli's own handling)
            _signal(server, signal.SIGTERM)
        else:
            _kill_session(server.pid)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    rc = server.wait()
    left = sweep_session(server.pid)
    if left:
        print(f"serve_cli: stopped {left} process(es) the server left behind", file=sys.stderr, flush=True)
    return rc if rc >= 0 else 128 - rc  # killed by signal N: 128 + N, as a shell reports it


def _signal(proc: subprocess.Popen, signum: int) -> None:
    try:
        proc.send_signal(signum)
    except ProcessLookupError:
        pass


def _kill_session(sid: int) -> None:
    _send(session_members(sid), signal.SIGKILL)
