"""LoRA adapters: served tokens against HF transformers + peft (three adapters made here with
peft, different ranks, target modules and alphas, B non-zero), mixed with base-model requests in
one batch; slots shared by more adapters than they hold; the prefix cache keyed by adapter;
adapters read once; bad adapters refused by name while the engine keeps serving."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from cluster.engine.llm import LLM
from cluster.lora import LoRAAdapterError, LoRARequest
from cluster.lora import registry as registry_mod
from cluster.lora.registry import LoRANotFoundError
from cluster.sampling_params import SamplingParams

from lora_cases import ADAPTERS, NUM_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def adapter_dirs(lora_adapters) -> dict[str, str]:
    return lora_adapters


@pytest.fixture(scope="module")
def reference(lora_reference):
    return lora_reference


def _llm(tiny_llama_dir: str, adapter_dirs: dict[str, str], **kwargs) -> LLM:
    options = dict(dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, lora_modules=adapter_dirs,
                   num_kv_blocks=256, block_size=4, max_model_len=256)
    options.update(kwargs)
    return LLM(tiny_llama_dir, **options)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, adapter_dirs) -> LLM:
    return _llm(tiny_llama_dir, adapter_dirs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)


def _mixed(llm: LLM) -> tuple[list[list[int]], list[str | None]]:
    names = [None, *ADAPTERS]
    prompts = [p for p in PROMPTS for _ in names]
    loras = [None if n is None else LoRARequest(n) for _ in PROMPTS for n in names]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs], [n for _ in PROMPTS for n in names]


def _expected(reference, names) -> list[list[int]]:
    return [reference[n][i // len([None, *ADAPTERS])] for i, n in enumerate(names)]


def _assert_idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_unfinished == 0 and stats.running == 0 and stats.waiting == 0
    assert stats.num_free_blocks == stats.num_blocks


def test_adapters_change_the_output(reference):
    """The reference itself: each adapter changes some prompt's tokens (else the test below
    could not tell a served adapter from the base model)."""
    for name in ADAPTERS:
        assert reference[name] != reference[None], name


def test_mixed_batch_matches_peft(llm, reference):
    got, names = _mixed(llm)
    assert got == _expected(reference, names)
    stats = llm.engine.stats()
    assert sorted(stats.lora_resident) == sorted(ADAPTERS)
    assert stats.lora_requests == {n: len(PROMPTS) for n in ADAPTERS}
    _assert_idle(llm)


def test_one_slot_serves_three_adapters_in_turn(tiny_llama_dir, adapter_dirs, reference):
    """Three adapters take turns in one slot; each load into the slot was announced to the
    worker (read ahead in the background) in an earlier step."""
    llm = _llm(tiny_llama_dir, adapter_dirs, max_loras=1)
    runner = llm.engine.executor.worker.runner
    plans, real = [], runner._update_states

    def record(plan):
        plans.append(plan)
        return real(plan)

    runner._update_states = record
    got, names = _mixed(llm)
    assert got == _expected(reference, names)
    loads = [(i, load.adapter.name) for i, plan in enumerate(plans) for load in plan.lora_loads]
    assert {name for _, name in loads} == set(ADAPTERS)
    for i, name in loads:
        assert any(a.name == name for plan in plans[:i] for a in plan.lora_prefetch), (i, name)
    stats = llm.engine.stats()
    assert stats.lora_slot_loads >= len(ADAPTERS)  # each adapter loaded into the one slot
    assert len(stats.lora_resident) == 1
    _assert_idle(llm)


def test_prefix_cache_is_keyed_by_adapter(llm):
    prompt = {"prompt_token_ids": list(range(100, 140))}  # 10 blocks of 4
    def cached(lora: str | None) -> int:
        out = llm.generate(prompt, GREEDY, use_tqdm=False, lora_request=None if lora is None else LoRARequest(lora))
        return out[0].num_cached_tokens

    assert cached("sql") == 0
    assert cached("sql") > 0  # the same adapter hits its own blocks
    assert cached("chat") == 0  # another adapter does not
    assert cached(None) == 0  # nor does the base model
    assert cached(None) > 0
    _assert_idle(llm)


def test_dynamic_folder_and_concurrent_first_use_read_once(tiny_llama_dir, adapter_dirs, monkeypatch, reference):
    root = str(Path(adapter_dirs["sql"]).parent)
    llm = _llm(tiny_llama_dir, {}, dynamic_lora_loading_path=root)
    reads = []
    real = registry_mod.read_adapter

    def counting(*args, **kwargs):
        reads.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(registry_mod, "read_adapter", counting)
    threads = [threading.Thread(target=llm.engine.prepare_lora, args=(LoRARequest("mlp"),)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert reads == ["mlp"]
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=LoRARequest("mlp"))
    assert out[0].outputs[0].token_ids == reference["mlp"][0]
    with pytest.raises(LoRANotFoundError, match="no LoRA adapter named 'nope'"):
        llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False, lora_request=LoRARequest("nope"))
    _assert_idle(llm)


def _copy_adapter(src: str, dst: Path, edit=None) -> str:
    dst.mkdir()
    config = json.loads(Path(src, "adapter_config.json").read_text())
    if edit:
        edit(config)
    Path(dst, "adapter_config.json").write_text(json.dumps(config))
    Path(dst, "adapter_model.safetensors").write_bytes(Path(src, "adapter_model.safetensors").read_bytes())
    return str(dst)


def test_bad_adapters_are_refused_by_name_and_the_rest_keep_serving(llm, adapter_dirs, reference, tmp_path):
    corrupt = _copy_adapter(adapter_dirs["sql"], tmp_path / "corrupt")
    Path(corrupt, "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    dora = _copy_adapter(adapter_dirs["sql"], tmp_path / "dora", lambda c: c.update(use_dora=True))
    cases = {
        "corrupt": (corrupt, "adapter_model.safetensors cannot be read"),
        "dora": (dora, "DoRA is not supported"),
        "missing": (str(tmp_path / "absent"), "no adapter_config.json"),
    }
    for name, (path, message) in cases.items():
        with pytest.raises(LoRAAdapterError, match=message):
            llm.generate([{"prompt_token_ids": PROMPTS[0]}], GREEDY, use_tqdm=False,
                         lora_request=LoRARequest(name, lora_path=path))
    got, names = _mixed(llm)
    assert got == _expected(reference, names)
    _assert_idle(llm)


def test_rank_above_max_lora_rank_and_unsupported_modules(tiny_llama_dir, adapter_dirs, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with pytest.raises(LoRAAdapterError, match="adapter 'mlp' has rank 16, above max_lora_rank=8"):
        _llm(tiny_llama_dir, {"mlp": adapter_dirs["mlp"]}, max_lora_rank=8)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    get_peft_model(base, LoraConfig(r=4, target_modules=["lm_head"])).save_pretrained(tmp_path / "head")
    with pytest.raises(LoRAAdapterError, match="not a LoRA weight of a supported module"):
        _llm(tiny_llama_dir, {"head": str(tmp_path / "head")})
    with pytest.raises(ValueError, match="lora_modules needs enable_lora=true"):
        LLM(tiny_llama_dir, dtype="float32", num_kv_blocks=64, lora_modules=adapter_dirs)


def test_adapters_with_speculative_decoding_structured_output_and_processors(tiny_llama_dir, adapter_dirs, reference):
    """Drafts are verified by the adapted model (greedy: the same tokens as without them); a
    grammar and a logits processor constrain an adapter's output like the base model's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1,
            "min_acceptance_rate": 0.0}
    llm = _llm(tiny_llama_dir, adapter_dirs, speculative_config=spec)
    got, names = _mixed(llm)
    assert got == _expected(reference, names)
    assert llm.engine.stats().spec_decode_num_drafts > 0
    from cluster.sampling_params import StructuredOutputsParams

    choice = SamplingParams(temperature=0.0, max_tokens=16,
                            structured_outputs=StructuredOutputsParams(choice=["alpha", "beta gamma"]))
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], choice, use_tqdm=False,
                        lora_request=LoRARequest("chat"))
    assert all(o.outputs[0].text in ("alpha", "beta gamma") for o in outs)
    # A logits processor (logit_bias, built in) acts on the adapted model's logits too.
    biased = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logit_bias={777: 100.0})
    outs = llm.generate([{"prompt_token_ids": PROMPTS[0]}], biased, use_tqdm=False, lora_request=LoRARequest("mlp"))
    assert outs[0].outputs[0].token_ids == [777] * 4
    _assert_idle(llm)


def test_adapters_on_a_quantized_base(tiny_llama_dir, adapter_dirs):
    """On an int8 base served as by default (dtype auto: fp32 activations), each adapter, kept in
    floats and added after the int8 product, moves the prompt's log-probabilities as it moves the
    float model's."""
    probe = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def shifts(llm: LLM) -> dict[str, torch.Tensor]:
        def logprobs(lora: LoRARequest | None) -> torch.Tensor:
            out = llm.generate({"prompt_token_ids": PROMPTS[0]}, probe, use_tqdm=False, lora_request=lora)[0]
            return torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(out.prompt_token_ids) if i])
        base = logprobs(None)
        return {name: logprobs(LoRARequest(name)) - base for name in ADAPTERS}

    quantized = _llm(tiny_llama_dir, adapter_dirs, dtype="auto", quantization="int8")
    assert quantized.config.model_config.torch_dtype == torch.float32
    want, got = shifts(_llm(tiny_llama_dir, adapter_dirs)), shifts(quantized)
    for name in ADAPTERS:
        assert want[name].abs().max() > 0.05, name  # the adapter visibly moves the float model
        assert (got[name] - want[name]).norm() <= 0.2 * want[name].norm(), (name, got[name], want[name])
