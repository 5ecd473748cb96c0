"""Bad input raises ValueError naming the field, and the engine keeps serving afterwards."""
import pytest

from cluster import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, dtype="float32", max_model_len=128, num_kv_blocks=64)


def _ok(llm):
    out = llm.generate(["hello there"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-3), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(n=0), "n"),
])
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_empty_prompt_rejected_then_serves(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt"):
        llm.generate([{"prompt_token_ids": []}], use_tqdm=False)
    _ok(llm)


def test_prompt_over_max_model_len_rejected_then_serves(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [5] * 200}], use_tqdm=False)
    _ok(llm)


def test_token_ids_outside_vocab_rejected(llm):
    with pytest.raises(ValueError, match="stop_token_ids"):
        llm.generate(["hi"], SamplingParams(stop_token_ids=[10**6]), use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, -4]}], use_tqdm=False)
    _ok(llm)


def test_one_bad_prompt_rejects_the_whole_call(llm):
    with pytest.raises(ValueError):
        llm.generate(["fine", ""], use_tqdm=False)
    assert not llm.engine.has_unfinished()
    _ok(llm)


def test_prompt_larger_than_kv_cache_rejected(tiny_llama_dir):
    small = LLM(tiny_llama_dir, dtype="float32", max_model_len=512, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([{"prompt_token_ids": [7] * 100}], use_tqdm=False)
    _ok(small)


def test_unknown_preset_and_options():
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="bogus_option"):
        LLM(bogus_option=3)
    with pytest.raises(ValueError, match="dtype"):
        LLM(dtype="int3")


@pytest.mark.parametrize("params, match", [
    (SamplingParams(n=129), r"n=129 .*max_n=128"),
    (SamplingParams(logprobs=21), r"logprobs=21 .*max_logprobs=20"),
    (SamplingParams(prompt_logprobs=21), r"prompt_logprobs=21 .*max_logprobs=20"),
    # vLLM's message shape: the context length and both parts of the request.
    (SamplingParams(max_tokens=10_000_000), r"max_tokens=10000000 .*maximum context length is 128 tokens.*"
                                           r"asks for 10000002 \(2 in the prompt, 10000000 in the completion\)"),
])
def test_request_limits_are_value_errors_naming_the_field(llm, params, match):
    before = llm.engine.stats()
    with pytest.raises(ValueError, match=match):
        llm.generate([{"prompt_token_ids": [5, 6]}], params, use_tqdm=False)
    assert llm.engine.stats() == before
    _ok(llm)


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority=3 needs scheduling_policy='priority'"):
        llm.generate(["hi"], use_tqdm=False, priority=[3])
    _ok(llm)


def test_huge_prompt_text_is_refused_before_tokenizing(llm, monkeypatch):
    limit = 128 * llm.tokenizer.max_token_chars  # no text past this can fit 128 tokens
    def must_not_tokenize(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")
    monkeypatch.setattr(llm.tokenizer.hf, "encode", must_not_tokenize)
    monkeypatch.setattr(llm.tokenizer.hf, "apply_chat_template", must_not_tokenize)
    with pytest.raises(ValueError, match=rf"prompt is too long: {limit + 1} characters .*\(at most {limit} characters\)"):
        llm.generate(["x" * (limit + 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="messages is too long"):
        llm.chat([{"role": "system", "content": "y" * limit}, {"role": "user", "content": "z"}], use_tqdm=False)
    monkeypatch.undo()
    _ok(llm)
