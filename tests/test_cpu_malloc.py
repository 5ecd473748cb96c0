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


def test_release_hands_freed_heap_memory_back():
    """With the settings above, freed blocks under the mmap threshold stay resident until
    release_freed_memory (what the worker runs once the packed weights moved to huge pages).
    In a child process: the settings are process-wide."""
    import subprocess
    import sys

    code = """
import torch
from cluster.worker.cpu_malloc import keep_freed_memory, release_freed_memory
def rss():
    return int(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmRSS')))
assert keep_freed_memory()
base = rss()
blocks = [torch.ones(1 << 20) for _ in range(64)]  # 64 x 4 MB, under the 32 MB mmap threshold
held = rss()
del blocks
kept = rss()
assert release_freed_memory()
print(held - base, kept - base, rss() - base)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    held, kept, released = map(int, out.stdout.split())
    assert held > 200_000 and kept > 200_000  # KiB: 256 MB allocated, still resident once freed
    assert released < 50_000
