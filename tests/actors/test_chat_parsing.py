"""Chat output parsing without Ray: reasoning split, tool-call parsers, tool specs, and the
default tool rendering. Streamed pieces must add up to the non-streamed answer for any chunking."""
import json
import random

import pytest

from actors.http.chat_parsers import ChoiceParser
from actors.http.reasoning_parser import ReasoningSplitter
from actors.http.tool_parser import (HermesParser, NamedCallParser, RequiredCallsParser, ToolSpecError,
                                     merge_tool_calls, tool_request)

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def chunks(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]


def streamed(make, text: str, rng: random.Random):
    """Feed a fresh parser the text in random chunks; returns (per-chunk outputs, whole output)."""
    parser = make()
    pieces = chunks(text, rng)
    outs = [parser.feed(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    return outs, make().feed(text, final=True)


# ---- reasoning --------------------------------------------------------------------------------
@pytest.mark.parametrize("text, thinking, reasoning, content", [
    ("<think>plan</think>answer", False, "plan", "answer"),
    ("  <think>\nplan\n</think>\n\nanswer", False, "\nplan\n", "\n\nanswer"),
    ("plan</think>answer", True, "plan", "answer"),
    ("just an answer <think>x</think>", False, None, "just an answer <think>x</think>"),
    ("still thinking </thi", True, "still thinking </thi", ""),
    ("<thi", False, None, "<thi"),
    ("a</think>b</think>c", True, "a", "b</think>c"),
])
def test_reasoning_split_whole_and_streamed(text, thinking, reasoning, content):
    make = lambda: ReasoningSplitter("<think>", "</think>", thinking)  # noqa: E731
    assert make().split(text) == (reasoning, content)
    rng = random.Random(0)
    for _ in range(50):
        outs, _ = streamed(make, text, rng)
        assert "".join(r for r, _ in outs) == (reasoning or "")
        assert "".join(c for _, c in outs) == content


# ---- tool-call parsers ----------------------------------------------------------------------
def _without_ids(calls):
    return [{**c, "id": None} for c in calls]


def check_streaming(make, text: str):
    """Content and merged calls are the same for every chunking; returns the whole result."""
    whole_content, whole_calls = make().feed(text, final=True)
    whole = (whole_content, _without_ids(merge_tool_calls(whole_calls)))
    rng = random.Random(1)
    for _ in range(60):
        outs, _ = streamed(make, text, rng)
        content = "".join(c for c, _ in outs)
        calls = merge_tool_calls([d for _, ds in outs for d in ds])
        assert (content, _without_ids(calls)) == whole
        assert all(c["id"].startswith("call_") for c in calls)
    return whole


def test_hermes_calls_and_content():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>\n')
    content, calls = check_streaming(lambda: HermesParser({"get_weather", "get_time"}), text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]


@pytest.mark.parametrize("text", [
    "No calls here, just <b>text</b> and a lone <tool_",
    '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call> stays text',
    '<tool_call>{not json}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": {}}',  # cut off: never closed
])
def test_hermes_non_calls_stay_content(text):
    content, calls = check_streaming(lambda: HermesParser({"get_weather", "get_time"}), text)
    assert calls == [] and content == text


def test_hermes_single_call_without_parallel():
    block = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    parser = HermesParser({"get_time"}, parallel=False)
    content, calls = parser.feed(block + block, final=True)
    assert len(calls) == 1 and content == block and parser.finish_reason == "tool_calls"


def test_required_calls_stream_their_arguments():
    text = ('[{"name": "get_weather", "parameters": {"city": "Paris, \\"FR\\" {x}"}}, '
            '{"name": "get_time", "parameters": {}}]')
    content, calls = check_streaming(RequiredCallsParser, text)
    assert content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Paris, \\"FR\\" {x}"}'), ("get_time", "{}")]
    # Argument fragments appear while the value is being written, not only at its end.
    parser, fragments = RequiredCallsParser(), []
    for ch in text:
        fragments += [d["function"]["arguments"] for d in parser.feed(ch)[1]]
    assert len(fragments) > 10 and "".join(fragments) == '{"city": "Paris, \\"FR\\" {x}"}{}'


def test_named_call_is_the_whole_answer():
    text = '{"city": "Lima"}'
    content, calls = check_streaming(lambda: NamedCallParser(name="get_weather"), text)
    assert content == "" and calls[0]["function"] == {"name": "get_weather", "arguments": text}
    assert NamedCallParser(name="x").finish_reason == "stop"


def test_choice_parser_reasoning_then_tools():
    text = '<think>need weather</think><tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    make = lambda: ChoiceParser(ReasoningSplitter("<think>", "</think>", False),  # noqa: E731
                                HermesParser({"get_weather"}), True)
    msg = make().message(text)
    assert msg["reasoning_content"] == msg["reasoning"] == "need weather"
    assert msg["content"] is None and msg["tool_calls"][0]["function"]["name"] == "get_weather"
    parser = make()
    deltas = [parser.delta(ch, final=i == len(text) - 1) for i, ch in enumerate(text)]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "need weather"
    assert merge_tool_calls([c for d in deltas for c in d.get("tool_calls", [])])[0]["function"] == \
        msg["tool_calls"][0]["function"]
    assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


# ---- tool specs ------------------------------------------------------------------------------
def test_tool_request_choices_and_constraints():
    import jsonschema

    req = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}})
    assert req.choice == "named" and req.constraint().json == WEATHER["function"]["parameters"]
    req = tool_request([WEATHER, TIME], "required", parallel_tool_calls=False)
    schema = req.constraint().json
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)  # one call only
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], schema)  # city is required
    assert tool_request([WEATHER], None).choice == "auto"
    assert tool_request([WEATHER], "auto").constraint() is None
    assert tool_request(None, None) is None and tool_request([], "none") is None


@pytest.mark.parametrize("tools, choice, field", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}], None,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "a string"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "tools[0].function.name"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ([WEATHER], {"type": "function"}, "tool_choice"),
    ([WEATHER], "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    (None, {"type": "function", "function": {"name": "get_weather"}}, "tool_choice"),
])
def test_bad_tool_specs_name_the_field(tools, choice, field):
    with pytest.raises(ToolSpecError) as info:
        tool_request(tools, choice)
    assert info.value.param == field and str(info.value).startswith(field)


# ---- rendering -------------------------------------------------------------------------------
CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
]


def test_default_tool_rendering_for_a_template_without_tools(smollm2_path):
    from cluster.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_path)
    assert "tools" not in tok.hf.chat_template  # SmolLM2's template knows nothing of tools
    text = tok.apply_chat_template(CONVERSATION, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\n# Tools")
    assert json.dumps(WEATHER) in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_tools_aware_template_gets_tools_and_parsed_arguments(tiny_llama_dir):
    from transformers import AutoTokenizer

    from cluster.tokenizer import Tokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama_dir)
    hf.chat_template = ("{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}{% for m in messages %}"
                        "<{{ m.role }}>{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}{% endfor %}"
                        "{{ m.content or '' }}{% endfor %}")
    text = Tokenizer(hf).apply_chat_template(CONVERSATION, tools=[WEATHER], add_generation_prompt=False)
    assert text == "[tool get_weather]<user>Weather in Paris?<assistant>Paris<tool>18 C, sunny"
