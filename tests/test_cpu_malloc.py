"""The CPU worker's glibc malloc settings (cluster/worker/cpu_malloc.py)."""
from __future__ import annotations

import os
import platform

from cluster.worker.cpu_malloc import keep_freed_memory


def test_applies_on_glibc_and_leaves_a_users_settings_alone(monkeypatch):
    for key in [k for k in os.environ if k.startswith("MALLOC_") or k == "GLIBC_TUNABLES"]:
        monkeypatch.delenv(key)
    assert keep_freed_memory() == (platform.libc_ver()[0] == "glibc")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=131072")
    assert keep_freed_memory() is False
