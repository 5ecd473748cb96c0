"""`python -m actors.serve_cli deploy.yaml [--drain-timeout-s S] [serve run options]`: `serve run`
kept on loopback, with a graceful shutdown.

What `make serve` runs. It sets the loopback environment and Ray Serve's throughput mode
(actors.env; any of those variables already set wins), starts a local Ray
on 127.0.0.1 unless RAY_ADDRESS names a cluster, with the Prometheus metrics endpoint on
$LLM_CLUSTER_METRICS_PORT (default 8080), then hands over to Ray Serve's own `serve run`.

The process started is a supervisor (actors/supervisor.py): it checks that the HTTP port (and,
for a local Ray, the metrics port) is free, naming the process that holds a taken one, then runs
the server (this module again) in a session of its own, and stops whatever is left of that
session once the server exits: no Ray daemon, worker or HAProxy outlives `serve run`, whether it
was stopped by a signal or killed.

SIGTERM (or Ctrl-C) shuts down gracefully: the ingress stops taking requests (503 with
Retry-After), the requests in flight finish, for at most --drain-timeout-s seconds
($LLM_CLUSTER_DRAIN_TIMEOUT_S, default 60), then Serve and the local Ray stop
(actors/http/drain.py); with nothing in flight that takes seconds. A second signal stops at once.
If Ray's own processes were killed too (a whole process group or cgroup signalled), there is
nothing to drain: the server stops without waiting on them.

`python -m actors.serve_cli shutdown [--address A] [--drain-timeout-s S]` does the same to a
Serve instance on a running cluster (one deployed with `serve deploy`, or by a serve_cli with
RAY_ADDRESS): Ray's own `serve shutdown` would cut every stream.
"""
from __future__ import annotations

import atexit
import os
import signal
import socket
import sys

from actors.env import apply_loopback_env, apply_serve_throughput_env
from actors.supervisor import SERVER_ENV, http_listener, supervise, sweep_session

DRAIN_TIMEOUT_ENV = "LLM_CLUSTER_DRAIN_TIMEOUT_S"
DEFAULT_DRAIN_TIMEOUT_S = 60.0
METRICS_PORT_ENV = "LLM_CLUSTER_METRICS_PORT"
DEFAULT_METRICS_PORT = 8080
# "0": the local Ray starts without its dashboard (the web UI and the state API behind
# `ray list` / ray.util.state); the metrics endpoint stays (Ray's agent serves it).
DASHBOARD_ENV = "LLM_CLUSTER_RAY_DASHBOARD"


class _Stop(BaseException):
    """A stop signal. Not an Exception (nor KeyboardInterrupt): `serve run` would shut Serve
    down at once on those, cutting every stream, before we drain."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame) -> None:
    raise _Stop(signum)


def _terminate(signum, frame) -> None:
    """The second signal (or the first before Serve runs): stop now, nothing drained."""
    _stop_local_ray(128 + signum)


def _drain_timeout(argv: list[str]) -> float:
    """--drain-timeout-s S (taken out of argv), else the environment, else the default."""
    value = os.environ.get(DRAIN_TIMEOUT_ENV, DEFAULT_DRAIN_TIMEOUT_S)
    if "--drain-timeout-s" in argv:
        i = argv.index("--drain-timeout-s")
        if i + 1 >= len(argv):
            raise SystemExit("--drain-timeout-s needs a number of seconds")
        value = argv[i + 1]
        del argv[i:i + 2]
    try:
        seconds = float(value)
    except ValueError:
        raise SystemExit(f"--drain-timeout-s must be a number of seconds, got {value!r}") from None
    if seconds < 0:
        raise SystemExit(f"--drain-timeout-s must be >= 0, got {seconds}")
    return seconds


def _dashboard() -> bool:
    """Whether the local Ray starts its dashboard: $LLM_CLUSTER_RAY_DASHBOARD, 1 (default) or 0."""
    value = os.environ.get(DASHBOARD_ENV, "1")
    if value not in ("0", "1"):
        raise SystemExit(f"${DASHBOARD_ENV} must be 1 or 0, got {value!r}")
    return value == "1"


def _shut_down(timeout_s: float, gcs_address: str | None = None) -> None:
    """Drain the ingress, then stop Serve. A second signal skips the rest (`_terminate`).
    `gcs_address`: the local Ray this process started. Serve then needs no shutdown of its own
    (its graceful one takes seconds more: each replica's wait loop): stopping that Ray stops
    Serve with it (`_stop_local_ray`). If that GCS no longer answers, Ray's processes were
    killed with us and there is nothing to drain (every Ray call would wait a minute for it)."""
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _terminate)
    if gcs_address is not None and not _answers(gcs_address):
        print(f"Ray's GCS at {gcs_address} is gone (Ray's processes were stopped too): nothing to drain",
              flush=True)
        return
    from ray import serve

    from actors.http.drain import drain, forget

    print(f"Draining: new requests get 503; waiting up to {timeout_s:g}s for those in flight", flush=True)
    drained, left = drain(timeout_s)
    print("Drained." if drained else f"Drain timed out with {left} requests in flight.", flush=True)
    if gcs_address is None:  # Serve on a cluster that stays up
        serve.shutdown()
        forget()


def _answers(address: str, timeout_s: float = 2.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def _sweep_own_session() -> None:
    """Stop what this server leaves in its session (Ray's daemons, workers, HAProxy), when it
    leads one (started by the supervisor): the last step of every exit."""
    if os.getsid(0) == os.getpid():
        sweep_session(os.getpid())


def _stop_local_ray(status: int) -> None:
    """Stop the local Ray as `ray stop` does (SIGTERM to each of its processes, SIGKILL to what
    lingers) and exit with `status`, skipping Ray's at-exit shutdown (it would talk to the GCS
    being stopped). Outside a session of its own, Ray's at-exit shutdown does it instead."""
    if os.getsid(0) != os.getpid():
        raise SystemExit(status)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        _sweep_own_session()
    finally:
        os._exit(status)


RAY_START_ATTEMPTS = 3


def _start_local_ray(metrics_port: int, dashboard: bool = True):
    """A local Ray on 127.0.0.1, tried again if its node does not register in time.

    Ray gives a starting raylet a fixed 30 s to register with its GCS; on a busy small
    machine that can pass while the GCS is still coming up. The half-started processes
    are this process's children (nothing else is started yet), so they are stopped
    before the next attempt."""
    import psutil
    import ray

    for attempt in range(1, RAY_START_ATTEMPTS + 1):
        try:
            # address="local": never attach to a cluster a stale /tmp/ray file points at.
            return ray.init(address="local", _node_ip_address="127.0.0.1", namespace="serve",
                            _metrics_export_port=metrics_port, include_dashboard=dashboard,
                            dashboard_host="127.0.0.1")
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == RAY_START_ATTEMPTS:
                raise
            print(f"Ray did not start (attempt {attempt}/{RAY_START_ATTEMPTS}: {e}); starting it again",
                  flush=True)
            ray.shutdown()
            children = psutil.Process().children(recursive=True)
            for child in children:
                child.terminate()
            _, alive = psutil.wait_procs(children, timeout=10)
            for child in alive:
                child.kill()


def shutdown(argv: list[str]) -> None:
    """`serve_cli shutdown [--address A] [--drain-timeout-s S]`: a graceful `serve shutdown`
    of the Serve instance on a running cluster (--address, else RAY_ADDRESS, else the local
    one): drain, then stop Serve. The cluster itself stays up."""
    timeout_s = _drain_timeout(argv)
    address = os.environ.get("RAY_ADDRESS", "auto")
    for flag in ("--address", "-a"):
        if flag in argv:
            if argv.index(flag) + 1 >= len(argv):
                raise SystemExit(f"{flag} needs the cluster's address (host:port)")
            address = argv[argv.index(flag) + 1]
    apply_loopback_env()  # before Ray is imported: 127.0.0.1 stays 127.0.0.1
    import ray

    ray.init(address=address, namespace="serve", log_to_driver=False, logging_level="ERROR")
    _shut_down(timeout_s)
    print("Serve shut down.", flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        raise SystemExit(0 if argv else 2)
    if argv[0] == "shutdown":
        return shutdown(argv[1:])
    server_argv = list(argv)
    timeout_s = _drain_timeout(argv)  # checked here too: a bad value fails before anything starts
    dashboard = _dashboard()
    local = not os.environ.get("RAY_ADDRESS") and "--address" not in argv and "-a" not in argv
    metrics_port = int(os.environ.get(METRICS_PORT_ENV, DEFAULT_METRICS_PORT))
    if os.environ.get(SERVER_ENV) != "1":
        raise SystemExit(supervise(server_argv, _ports(argv, metrics_port) if local else []))
    _serve(argv, timeout_s, metrics_port if local else None, dashboard)


def _ports(argv: list[str], metrics_port: int) -> list[tuple[str, int, str]]:
    """What a local server listens on at fixed ports: Serve's HTTP port, Ray's metrics, and
    Serve's HAProxy's stats and Prometheus listeners (fixed in Ray's template, changed by the
    two variables) and its fallback proxy, each (host, port, where it is set). The fallback
    proxy binds with SO_REUSEPORT, so a second server on the same port would not fail: the two
    HAProxies would share the connections sent to it and one server answer with the other's
    applications."""
    ports = [http_listener(argv), ("127.0.0.1", metrics_port, f"${METRICS_PORT_ENV}, Ray's metrics")]
    env = apply_serve_throughput_env(dict(os.environ))
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") == "1":
        for var, default, what in (("RAY_SERVE_HAPROXY_STATS_PORT", 8404, "HAProxy stats"),
                                   ("RAY_SERVE_HAPROXY_METRICS_PORT", 9101, "HAProxy Prometheus"),
                                   ("RAY_SERVE_FALLBACK_PROXY_HTTP_PORT", 8500, "fallback proxy behind HAProxy")):
            ports.append(("127.0.0.1", int(env.get(var, default)), f"${var}, Serve's {what}"))
    return ports


def _serve(argv: list[str], timeout_s: float, metrics_port: int | None, dashboard: bool = True) -> None:
    """The server: the local Ray (unless `metrics_port` is None: a cluster named), then Serve's
    `serve run argv` until a stop signal."""
    atexit.register(_sweep_own_session)  # before Ray's own atexit, so it runs after Ray's shutdown
    apply_loopback_env()
    apply_serve_throughput_env()  # before Ray starts: its processes read these at import
    # Ray nices its worker processes (15) so batch jobs yield to the raylet; here the workers
    # are the served model, and a niced model loses its cores to any other busy process.
    os.environ.setdefault("RAY_worker_niceness", "0")
    # The GCS keeps every task event it is sent, up to 100k by default (~3 KB each): on a server
    # that runs for days that is ~300 MB of history. The dashboard shows the latest 10k.
    os.environ.setdefault("RAY_task_events_max_num_task_in_gcs", "10000")
    signal.signal(signal.SIGTERM, _terminate)  # until Serve runs: nothing to drain yet
    from ray.serve.scripts import run

    gcs_address = None
    if metrics_port is not None:
        ctx = _start_local_ray(metrics_port, dashboard)
        gcs_address = ctx.address_info["gcs_address"]
        where = f"http://{ctx.dashboard_url}" if dashboard else f"off (${DASHBOARD_ENV}=0)"
        print(f"Ray on 127.0.0.1: address {gcs_address}, dashboard {where}, "
              f"metrics http://127.0.0.1:{metrics_port}/metrics", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):  # ray.init installed its own SIGTERM handler
        signal.signal(sig, _stop)
    try:
        run.main(args=argv, prog_name="serve run", standalone_mode=True)
    except _Stop as stop:
        _shut_down(timeout_s, gcs_address)
        if gcs_address is None:
            raise SystemExit(128 + stop.signum) from None
        _stop_local_ray(128 + stop.signum)


if __name__ == "__main__":
    main()
