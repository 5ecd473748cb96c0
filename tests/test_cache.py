"""The converted-file cache stays as large as the files it serves: writing an entry removes the
entries of sources that are gone or were replaced, and nothing else."""
from __future__ import annotations

import os
from pathlib import Path

from cluster.cache import cache_key, record_source
from cluster.tokenizer import Tokenizer, _gguf_cache_dir


def _entry(root: Path, source: Path, recorded: bool = True) -> Path:
    entry = root / f"{source.stem}-{cache_key(source)}"
    entry.mkdir(parents=True)
    (entry / "model.safetensors").write_bytes(b"tensors")
    if recorded:
        record_source(entry, source)
    return entry


def test_an_entry_of_a_gone_or_replaced_source_is_removed_and_the_rest_kept(tmp_path):
    models, root = tmp_path / "models", tmp_path / "cache"
    models.mkdir()
    kept_file, gone_file, changed_file, legacy_file = (models / f"{n}.gguf" for n in ("kept", "gone", "changed", "legacy"))
    for f in (kept_file, gone_file, changed_file, legacy_file):
        f.write_bytes(b"gguf")
    kept, gone, old = _entry(root, kept_file), _entry(root, gone_file), _entry(root, changed_file)
    legacy = _entry(root, legacy_file, recorded=False)  # written before sources were recorded
    other_folder = _entry(root / "tokenizers", changed_file)  # another kind of entry of the same file
    gone_file.unlink()
    changed_file.write_bytes(b"gguf, downloaded again")
    new = _entry(root, changed_file)

    assert new != old
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [kept.name, f"{kept.name}.source", legacy.name, new.name, f"{new.name}.source", "tokenizers"])
    assert (new / "model.safetensors").is_file() and (kept / "model.safetensors").is_file()
    assert (root / f"{new.name}.source").read_text() == str(changed_file.resolve())
    assert other_folder.is_dir()  # pruned only by an entry written beside it


def test_the_tokenizer_cache_drops_the_entry_of_a_deleted_file(smollm2_path, tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    os.link(smollm2_path, first)
    assert Tokenizer.load(str(first), cache_dir=cache).source == "gguf"
    first_entry = _gguf_cache_dir(first, cache)
    assert first_entry.is_dir()
    first.unlink()
    os.link(smollm2_path, second)
    assert Tokenizer.load(str(second), cache_dir=cache).source == "gguf"
    assert not first_entry.exists()
    assert [p.name for p in (cache / "tokenizers").iterdir() if p.is_dir()] == [_gguf_cache_dir(second, cache).name]
    assert Tokenizer.load(str(second), cache_dir=cache).source == "cache"
