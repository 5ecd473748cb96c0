"""The on-disk cache of converted model files: `$LLM_CLUSTER_CACHE` or ~/.cache/llm-cluster.

Converting a GGUF (its vocabulary, its config, its dequantized tensors) takes seconds, so the
results are kept here, keyed by the source file's path, size and mtime. Several processes
(TP ranks, parallel tests) may convert at once: every entry is written aside and renamed.

Each entry names its source in a `<entry>.source` file beside it, so the cache stays as large as
the files it serves: writing an entry removes the entries whose source is gone (a deleted or
temporary file) and those of an older version of the same file (replaced, re-downloaded).
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


def record_source(entry: Path, source: Path) -> None:
    """Note that `entry` (a folder of the cache) was made from `source`, and remove the sibling
    entries that can never be read again: their source is gone, or is this same path (an older
    version of the file: a different size or mtime gives a different key). Entries written before
    sources were recorded are left alone."""
    path = str(source.resolve())
    marker = entry.parent / f"{entry.name}.source"
    try:
        write_atomically(marker, lambda tmp: tmp.write_text(path))
        for other in entry.parent.glob("*.source"):
            if other != marker:
                _drop_if_stale(other, path)
    except OSError as exc:  # pruning is housekeeping: never fail a load over it
        logger.warning("could not prune the cache beside %s: %s", entry, exc)


def _drop_if_stale(marker: Path, source: str) -> None:
    try:
        recorded = marker.read_text()
    except OSError:  # removed by another process meanwhile
        return
    if recorded != source and Path(recorded).exists():
        return
    entry = marker.with_suffix("")
    logger.info("removing the cache entry %s: its source %s is gone or changed", entry, recorded)
    shutil.rmtree(entry, ignore_errors=True) if entry.is_dir() else entry.unlink(missing_ok=True)
    marker.unlink(missing_ok=True)
