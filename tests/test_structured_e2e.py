"""Structured output through the offline engine with the real SmolLM2 (fp32, greedy)."""
import json
import re

import jsonschema
import pytest

from cluster import LLM, SamplingParams
from cluster import StructuredOutputsParams as SO

PERSON = {"type": "object", "required": ["name", "age", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 16},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
             "minItems": 1, "maxItems": 3}}}
ORDER = {"type": "object", "required": ["id", "customer", "status"], "properties": {
    "id": {"type": "integer", "minimum": 1000, "maximum": 9999},
    "customer": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "vip": {"type": "boolean"}}},
    "status": {"type": "string", "enum": ["open", "shipped", "closed"]}}}
ARITH = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
"""


def _arith_ok(s: str) -> bool:
    pos = 0

    def factor():
        nonlocal pos
        if pos < len(s) and s[pos] == "(":
            pos += 1
            expr()
            assert s[pos] == ")"
            pos += 1
            return
        start = pos
        while pos < len(s) and s[pos].isdigit():
            pos += 1
        assert pos > start

    def term():
        nonlocal pos
        factor()
        while pos < len(s) and s[pos] in "*/":
            pos += 1
            factor()

    def expr():
        nonlocal pos
        term()
        while pos < len(s) and s[pos] in "+-":
            pos += 1
            term()
    try:
        expr()
        return pos == len(s)
    except (AssertionError, IndexError):
        return False


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, dtype="float32", max_model_len=512, max_num_seqs=8)


def _chat(llm, content, **kw):
    prompt = f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 64), **kw), prompt


def test_schemas_and_constraint_kinds(llm):
    cases = [
        _chat(llm, "Describe a person as JSON.", structured_outputs=SO(json=PERSON, disable_any_whitespace=True)),
        _chat(llm, "Give an order as JSON.", structured_outputs=SO(json=json.dumps(ORDER), disable_any_whitespace=True)),
        _chat(llm, "Give me any JSON object.", structured_outputs=SO(json_object=True, disable_any_whitespace=True),
              max_tokens=96),
        _chat(llm, "What is the date today?", structured_outputs=SO(regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]")),
        _chat(llm, "Is the sky blue?", structured_outputs=SO(choice=["yes", "no", "maybe"])),
        _chat(llm, "Write an arithmetic expression.", structured_outputs=SO(grammar=ARITH), max_tokens=24),
    ]
    outs = llm.generate([p for _, p in cases], [sp for sp, _ in cases], use_tqdm=False)
    texts = [o.outputs[0].text for o in outs]
    jsonschema.validate(json.loads(texts[0]), PERSON)
    jsonschema.validate(json.loads(texts[1]), ORDER)
    assert isinstance(json.loads(texts[2]), dict)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", texts[3])
    assert texts[4] in ("yes", "no", "maybe")
    # The arithmetic grammar never forces an end: a length stop leaves a valid prefix of it
    # whose completed part parses; a natural stop must parse whole.
    if outs[5].outputs[0].finish_reason == "stop":
        assert _arith_ok(texts[5]), texts[5]
    else:
        assert re.fullmatch(r"[0-9()+\-*/]+", texts[5]), texts[5]
    assert [o.outputs[0].finish_reason for o in outs[:5]] == ["stop"] * 5


def test_mixed_batch_leaves_unconstrained_rows_alone(llm):
    free = [_chat(llm, q, ignore_eos=True, max_tokens=24)
            for q in ("Tell me about cats.", "Count to five.", "Name a colour.")]
    alone = llm.generate([p for _, p in free], [sp for sp, _ in free], use_tqdm=False)
    constrained = [_chat(llm, "A person as JSON", structured_outputs=SO(json=PERSON)),
                   _chat(llm, "yes or no?", structured_outputs=SO(choice=["yes", "no"]))]
    mixed = free[:1] + constrained[:1] + free[1:] + constrained[1:]
    outs = llm.generate([p for _, p in mixed], [sp for sp, _ in mixed], use_tqdm=False)
    got = [outs[0], outs[2], outs[3]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(outs[1].outputs[0].text), PERSON)


@pytest.mark.parametrize("spec, reason", [
    (SO(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "json"),
    (SO(regex="(unclosed"), "regex"),
    (SO(grammar="root ::= missing_rule"), "grammar"),
])
def test_invalid_specs_rejected_at_entry_then_serves(llm, spec, reason):
    sp, prompt = _chat(llm, "hi", structured_outputs=spec)
    with pytest.raises(ValueError, match=reason):
        llm.generate([prompt], sp, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    sp, prompt = _chat(llm, "yes or no?", structured_outputs=SO(choice=["yes", "no"]))
    assert llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0].text in ("yes", "no")


def test_two_constraints_rejected():
    with pytest.raises(ValueError, match="exactly one"):
        SO(regex="a+", choice=["a"])


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_preemption_mid_grammar_still_valid(smollm2_path, async_scheduling):
    small = LLM(smollm2_path, dtype="float32", max_model_len=256, num_kv_blocks=10, block_size=16,
                max_num_seqs=4, async_scheduling=async_scheduling)
    cases = [_chat(small, f"Describe person number {i} as JSON.", max_tokens=60,
                   structured_outputs=SO(json=PERSON)) for i in range(4)]
    outs = small.generate([p for _, p in cases], [sp for sp, _ in cases], use_tqdm=False)
    assert small.engine.stats().preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
        jsonschema.validate(json.loads(o.outputs[0].text), PERSON)
    stats = small.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks
