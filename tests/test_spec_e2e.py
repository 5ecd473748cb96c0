"""Speculative decoding end to end on the real SmolLM2 (fp32): the same tokens with and without
it, under prefix caching, chunked prefill and preemption; min_tokens, logit_bias, stop ids, a stop
string, a JSON schema, a thinking budget and a seeded random request exact under it; custom
processors refused unless they declare support (the tiny model)."""
import json
import logging

import pytest

from cluster import LLM, SamplingParams
from cluster.sample.logits_processor import AdapterLogitsProcessor
from cluster.sampling_params import StructuredOutputsParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "min_acceptance_rate": 0.0}  # always draft: these tests are about exactness, not policy
PASSAGE = ("The old lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a "
           "brass lantern and a notebook in which he recorded the ships that passed the rocky point.")
CAT = [{"role": "user", "content": "Repeat exactly: the cat sat on the mat."},
       {"role": "assistant", "content": "the cat sat on the mat."},
       {"role": "user", "content": "Again, repeat exactly: the cat sat on the mat."}]


def chat_ids(llm: LLM, messages) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), False)


def tokens_of(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def spy_acceptance(llm: LLM) -> dict[str, int]:
    """Accepted draft tokens per request id, recorded as the engine verifies them."""
    accepted: dict[str, int] = {}
    drafter = llm.engine.scheduler.drafter
    record = drafter.record

    def spy(req_id: str, num_drafted: int, num_accepted: int) -> None:
        accepted[req_id] = accepted.get(req_id, 0) + num_accepted
        record(req_id, num_drafted, num_accepted)

    drafter.record = spy
    return accepted


# ---- greedy: identical tokens through prefix caching, chunked prefill and preemption ----------------
def test_greedy_tokens_identical_with_and_without_speculation(smollm2_path):
    options = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64, block_size=16,
                   num_kv_blocks=26, enable_prefix_caching=True)
    plain = LLM(smollm2_path, **options)
    tok = plain.get_tokenizer()
    prompts = [
        {"prompt_token_ids": chat_ids(plain, CAT)},
        "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
        f"Here is a passage:\n{PASSAGE}\nRepeat the passage exactly:\n",
        f"Here is a passage:\n{PASSAGE}\nNow copy it word for word:\n",  # shares a cached prefix
        "Write a haiku about the ocean.",
        "Once upon a time in a small village, there lived an old clockmaker who",
        "List three primary colors:",
        "Explain what a CPU does in one paragraph.",
    ]
    prompts = [p if isinstance(p, dict) else {"prompt_token_ids": tok.encode(p)} for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    want = tokens_of(plain.generate(prompts, params, use_tqdm=False))
    del plain
    spec = LLM(smollm2_path, speculative_config=SPEC, **options)
    accepted = spy_acceptance(spec)
    got = tokens_of(spec.generate(prompts, params, use_tqdm=False))
    for i, (a, b) in enumerate(zip(got, want)):
        assert a == b, i
    stats = spec.engine.stats()
    assert stats.preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.num_free_blocks == stats.num_blocks  # rejected-draft slots all came back
    assert stats.spec_decode_num_accepted_tokens > 20
    assert stats.spec_decode_mean_acceptance_length == pytest.approx(
        1 + stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_drafts)
    assert stats.generation_tokens == 48 * len(prompts)
    copy_heavy = {"0", "1", "2", "3"}  # request ids in prompt order
    assert all(accepted.get(r, 0) > 0 for r in copy_heavy), accepted


# ---- each feature exact under speculation -------------------------------------------------------------
REASONING = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
SHORT_NAME = {**SCHEMA, "properties": {"name": {"type": "string", "maxLength": 24},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}}}


def feature_requests(llm: LLM) -> list[tuple[str, dict, SamplingParams]]:
    tok = llm.get_tokenizer()
    cat = chat_ids(llm, CAT)
    counting = tok.encode("Count in words: one two three four five six seven eight nine ten eleven twelve "
                          "thirteen fourteen.\n<think>one two three")
    json_prompt = chat_ids(llm, [{"role": "user", "content":
                                  'Reply with this JSON exactly: {"name": "Alice Smith", "age": "thirty", '
                                  '"city": "Paris"}'}])
    greedy = dict(temperature=0.0, max_tokens=24)
    return [
        ("min_tokens", {"prompt_token_ids": cat}, SamplingParams(min_tokens=20, **greedy)),
        ("logit_bias", {"prompt_token_ids": cat}, SamplingParams(logit_bias={30: -100.0}, **greedy)),
        ("stop_ids", {"prompt_token_ids": cat}, SamplingParams(stop_token_ids=[1171], **greedy)),
        ("stop_string", {"prompt_token_ids": cat}, SamplingParams(stop=["sat on"], **greedy)),
        ("json", {"prompt_token_ids": json_prompt}, SamplingParams(
            structured_outputs=StructuredOutputsParams(json=SCHEMA), temperature=0.0, max_tokens=40)),
        ("budget", {"prompt_token_ids": counting}, SamplingParams(thinking_token_budget=8, **greedy)),
        ("seeded", {"prompt_token_ids": counting}, SamplingParams(temperature=0.8, seed=1234, max_tokens=24)),
        # Drafts while thinking go through the grammar's reasoning gate, not the matcher.
        ("think_json", {"prompt_token_ids": counting}, SamplingParams(
            structured_outputs=StructuredOutputsParams(json=SHORT_NAME), thinking_token_budget=8, temperature=0.0,
            max_tokens=64)),
    ]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def feature_runs(smollm2_path):
    options = dict(dtype="float32", max_model_len=512, reasoning_config=REASONING)
    plain = LLM(smollm2_path, **options)
    reqs = feature_requests(plain)
    want = plain.generate([p for _, p, _ in reqs], [s for _, _, s in reqs], use_tqdm=False)
    del plain
    spec = LLM(smollm2_path, speculative_config=SPEC, **options)
    accepted = spy_acceptance(spec)
    # A matcher left ahead by un-rolled-back drafts refuses the tokens reported next: logged.
    refused = _Records()
    logging.getLogger("cluster.structured_output.matcher").addHandler(refused)
    try:
        got = spec.generate([p for _, p, _ in reqs], [s for _, _, s in reqs], use_tqdm=False)
    finally:
        logging.getLogger("cluster.structured_output.matcher").removeHandler(refused)
    assert not refused.records, [r.getMessage() for r in refused.records]
    names = [name for name, _, _ in reqs]
    by_name = {name: (g.outputs[0], w.outputs[0], p["prompt_token_ids"])
               for (name, p, _), g, w in zip(reqs, got, want)}
    accepted = {names[int(rid)]: n for rid, n in accepted.items()}
    return by_name, accepted, spec


@pytest.mark.parametrize("name", ["min_tokens", "logit_bias", "stop_ids", "stop_string", "json", "budget",
                                  "seeded", "think_json"])
def test_feature_exact_under_speculation(feature_runs, name):
    by_name, accepted, spec = feature_runs
    got, want, prompt = by_name[name]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert (got.finish_reason, got.stop_reason) == (want.finish_reason, want.stop_reason)
    assert accepted.get(name, 0) > 0, accepted  # drafts were verified and accepted for it
    ids = got.token_ids
    eos = spec.config.model_config.eos_token_id
    if name == "min_tokens":
        assert eos not in ids[:20]
    elif name == "logit_bias":
        assert 30 not in ids  # "." banned: the copied sentence cannot end as in the prompt
    elif name == "stop_ids":
        assert got.finish_reason == "stop" and got.stop_reason == 1171 and ids[-1] == 1171
    elif name == "stop_string":  # drafts ran past it; the output ends at the token completing it
        assert got.stop_reason == "sat on" and got.text == "the cat " and ids[-2:] == [2643, 335]  # " sat on"
    elif name == "json":
        # The drafts copy "thirty"; the grammar wants an integer there: rejected drafts,
        # rolled-back matchers, and the copy resumes for the name.
        value = json.loads(got.text)
        assert value["name"] == "Alice Smith" and isinstance(value["age"], int) and set(value) == {"name", "age"}
    elif name == "budget":
        start, end = spec.config.reasoning_token_ids
        opened = max(i + len(start) for i in range(len(prompt)) if prompt[i:i + len(start)] == start)
        left = 8 - (len(prompt) - opened)  # the prompt's think block counts against the budget
        assert 0 < left and ids[left:left + len(end)] == end
        assert not any(ids[i:i + len(end)] == end for i in range(left))
    elif name == "think_json":  # thinks (drafts accepted there), is cut off, answers in the schema
        end = spec.config.reasoning_token_ids[1]
        at = next(i for i in range(len(ids)) if ids[i:i + len(end)] == end) + len(end)
        assert got.finish_reason == "stop", spec.get_tokenizer().decode(ids)
        answer = json.loads(spec.get_tokenizer().decode(ids[at:]))
        assert set(answer) == {"name", "age"} and len(answer["name"]) <= 24 and isinstance(answer["age"], int)


# ---- custom processors ----------------------------------------------------------------------------------
class NoRepeat(AdapterLogitsProcessor):
    """Bans repeating the previous output token: depends on the output, so each draft
    position must see the drafts before it. Declares it is exact under speculation."""

    @classmethod
    def supports_spec_decode(cls) -> bool:
        return True

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        def no_repeat(output_ids, logits):
            if output_ids:
                logits[output_ids[-1]] = float("-inf")
            return logits
        return no_repeat if (params.extra_args or {}).get("no_repeat") else None


class Undeclared(NoRepeat):
    @classmethod
    def supports_spec_decode(cls) -> bool:
        return False


def test_custom_processors_need_declared_spec_support(tiny_llama_dir):
    with pytest.raises(ValueError, match="does not support speculative decoding"):
        LLM(tiny_llama_dir, logits_processors=[Undeclared], speculative_config=SPEC)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 12}, {"prompt_token_ids": [9, 10, 11] * 10}]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, extra_args={"no_repeat": True})
    options = dict(dtype="float32", logits_processors=[NoRepeat])
    want = tokens_of(LLM(tiny_llama_dir, **options).generate(prompts, params, use_tqdm=False))
    spec = LLM(tiny_llama_dir, speculative_config=SPEC, **options)
    got = tokens_of(spec.generate(prompts, params, use_tqdm=False))
    assert got == want
    assert all(a != b for ids in got for a, b in zip(ids, ids[1:]))
    assert spec.engine.stats().spec_decode_num_drafts > 0
