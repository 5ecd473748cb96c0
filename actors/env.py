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


def apply_loopback_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """Set the loopback defaults in `env` (default: os.environ) unless already set."""
    env = os.environ if env is None else env
    for key, value in LOOPBACK_ENV.items():
        env.setdefault(key, value)
    return env
