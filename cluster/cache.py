"""The on-disk cache of converted model files: `$LLM_CLUSTER_CACHE` or ~/.cache/llm-cluster.

Converting a GGUF (its vocabulary, its config, its dequantized tensors) takes seconds, so the
results are kept here, keyed by the source file's path, size and mtime. Several processes
(TP ranks, parallel tests) may convert at once: every entry is written aside and renamed.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    return Path(os.environ.get("LLM_CLUSTER_CACHE", "~/.cache/llm-cluster")).expanduser()


def cache_key(source: Path, *extra: str) -> str:
    """16 hex digits naming `source` as it is now (path, size, mtime) plus `extra`."""
    path = source.resolve()
    st = path.stat()
    text = "|".join([str(path), str(st.st_size), str(st.st_mtime_ns), *extra])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def write_atomically(final: Path, write: Callable[[Path], None], directory: bool = False) -> None:
    """`write(tmp)` fills a temporary file (or folder) beside `final`, which is then renamed
    into place. The cache is an optimisation: a failure costs the next load its speed only."""
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}.tmp-"))
        else:
            fd, name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.tmp-")
            os.close(fd)
            tmp = Path(name)
        write(tmp)
        try:
            os.replace(tmp, final)
        except OSError:
            if not (directory and final.is_dir()):  # else another process's copy is in place
                raise
        else:
            tmp = None
    except OSError as exc:
        logger.warning("could not write the cache entry %s: %s", final, exc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
