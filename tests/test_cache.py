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


def test_prepare_converts_a_gguf_once_and_the_engine_reads_the_cache(smollm2_path, tmp_path, monkeypatch, capsys):
    """`python -m cluster.model.prepare FILE` (what `make install` runs for the default model)
    writes the config, the tokenizer and the dequantized weights into the cache; the engine's own
    loads then read them back unchanged, and a second run converts nothing."""
    import pytest
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from cluster.model import prepare
    from cluster.model.loader import gguf_cache_dir, iter_weights, load_hf_config
    from gguf_kquants import write_llama_gguf

    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    tensors = {k: v.float().numpy() for k, v in LlamaForCausalLM(config).state_dict().items() if k != "lm_head.weight"}
    gguf = tmp_path / "tiny.Q8_0.gguf"
    write_llama_gguf(gguf, config, tensors, lambda name: "Q8_0", tokenizer_gguf=smollm2_path)
    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(tmp_path / "cache"))

    entry = gguf_cache_dir(gguf)
    weights, tokenizer = entry / "model.safetensors", _gguf_cache_dir(gguf, tmp_path / "cache")
    prepare.main([str(gguf), "--quantization", "gguf"])  # served in its blocks: no dequantized copy
    assert (entry / "config.json").is_file() and tokenizer.is_dir() and not weights.exists()
    prepare.main([str(gguf)])
    assert f"{gguf}: ready in the cache" in capsys.readouterr().out
    assert (entry / "config.json").is_file() and weights.is_file() and tokenizer.is_dir()
    written = {p: p.stat().st_mtime_ns for p in (entry / "config.json", weights)}

    assert Tokenizer.load(str(gguf)).source == "cache"
    cached = dict(iter_weights(str(gguf), load_hf_config(str(gguf))))
    assert cached.keys() == tensors.keys()
    for name, w in tensors.items():  # the weights written, within Q8_0's rounding (over half a step: the step is fp16)
        want = torch.from_numpy(w)
        assert torch.allclose(cached[name], want, rtol=0, atol=want.abs().max().item() / 200), name
    prepare.main([str(gguf)])
    assert {p: p.stat().st_mtime_ns for p in written} == written  # read back, not converted again

    with pytest.raises(SystemExit, match="'no-such-model' is neither a known preset"):
        prepare.main(["no-such-model"])
