"""Environment that keeps a local Ray cluster on loopback and open (no token auth)."""
from __future__ import annotations

import os

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


# Ray Serve's throughput mode (Ray >= 2.55): handle calls between deployments over gRPC, user
# code and the router on the replica's main event loop, GC frozen after start-up. On the 2-core
# CPU default the ingress, the Serve proxy and the engine share cores with the model; this mode
# roughly halves their CPU per streamed chunk (benchmarks/serve.py: c=64 went from ~300 to ~345
# output tok/s at stream_interval 1). Direct ingress stays off: its replica HTTP ports are not
# behind http_options, and port 8000 keeps going through the proxy. Serve logs stay on stderr.
SERVE_THROUGHPUT_ENV = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_LOG_TO_STDERR": "1",
}


def apply_serve_throughput_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set Ray Serve's throughput-mode defaults in `env` (default: os.environ) unless already set."""
    return _set_defaults(SERVE_THROUGHPUT_ENV, env)
