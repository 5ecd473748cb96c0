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


def test_config_values_round_trip_through_json():
    import pytest
    import torch

    from cluster.model.hf_config import HFConfig

    text = HFConfig(model_type="text", dtype=torch.bfloat16, sizes=(1, 2), id2label={0: "a"}, pairs={(1, 2): [3]},
                    limit=float("inf"), tagged={"__items__": 1})
    config = HFConfig(model_type="outer", text_config=text, names=["x"], rope_scaling=None, eps=1e-6)
    back = HFConfig.from_json(config.to_json())
    assert back == config and isinstance(back.text_config, HFConfig)
    assert back.text_config.dtype is torch.bfloat16 and back.text_config.sizes == (1, 2)
    with pytest.raises(TypeError, match="type set"):
        HFConfig(model_type="x", labels={1, 2}).to_json()


def test_a_resolved_config_is_read_back_from_the_cache_without_transformers_config_classes(
        tiny_llama_dir, tmp_path, monkeypatch):
    """Every app build and `LLM` resolves its model's config: the first resolution of a
    config.json goes through transformers (its config classes import torch.distributed.tensor and
    sympy) and is kept; the next, in any process, reads the same values back without them. An
    edited config.json is resolved again (its old entry removed), a damaged entry rebuilt."""
    import json
    import shutil
    import subprocess
    import sys

    from cluster.model.hf_config import HFConfig
    from cluster.model.loader import load_hf_config, resolved_hf_config

    monkeypatch.setenv("LLM_CLUSTER_CACHE", str(tmp_path / "cache"))
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    first = resolved_hf_config(str(model))
    assert first == HFConfig.of(load_hf_config(str(model)))

    code = ("import sys; from cluster.model.loader import resolved_hf_config; c = resolved_hf_config(sys.argv[1]); "
            "print(c.to_json()); print(sorted(m for m in ('torch.distributed.tensor', 'sympy', "
            "'transformers.models.llama.configuration_llama') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}).stdout.splitlines()
    assert HFConfig.from_json(out[0]) == first
    assert out[1] == "[]"

    entries = tmp_path / "cache" / "hf-config"
    values = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**values, "rms_norm_eps": 1e-3}))
    edited = resolved_hf_config(str(model))
    assert edited.rms_norm_eps == 1e-3 and first.rms_norm_eps != 1e-3
    (entry,) = entries.glob("*.json")
    entry.write_text('{"__hf_config__": ')
    assert resolved_hf_config(str(model)) == edited
    assert HFConfig.from_json(entry.read_text()) == edited
