"""Anthropic's Messages API without Ray: requests onto the chat path, the message and its events
(validated by the anthropic SDK's own types and its stream accumulator), stop reasons, cut calls
and the error shape. tests/actors/smollm2_apis/test_anthropic.py serves it end to end."""
import json

import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from actors.http.anthropic_format import MessageBuilder, error_body, error_status, sse
from actors.http.anthropic_protocol import CountTokensRequest, MessagesRequest, to_chat, translate_error
from actors.http.chat_parsers import ChoiceParser
from actors.http.openai_protocol import OpenAIError, chat_params, chat_tools, retry_later
from actors.http.reasoning_parser import ReasoningSplitter
from actors.http.tool_parser import HermesParser, NamedCallParser, RequiredCallsParser
from cluster.outputs import CompletionOutput

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

EVENTS = TypeAdapter(RawMessageStreamEvent)
ADD = {"name": "add", "description": "Add two integers",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"]}}


def _translate(body: dict, reasoning: bool = False, model=MessagesRequest):
    return to_chat(model.model_validate({"max_tokens": 16, **body}), reasoning)


def _error(body: dict, reasoning: bool = False) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        t = _translate(body, reasoning)
        chat_params(t.chat, chat_tools(t.chat))
    return translate_error(info.value)


# ---- requests -> chat --------------------------------------------------------------------------
def test_turns_become_the_chat_conversation():
    t = _translate({"system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
                    "messages": [
                        {"role": "user", "content": "2+3?"},
                        {"role": "assistant", "content": [
                            {"type": "thinking", "thinking": "hm", "signature": ""},
                            {"type": "text", "text": "Let me add."},
                            {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
                            {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {"a": 1, "b": 1}}]},
                        {"role": "user", "content": [
                            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                             "content": [{"type": "text", "text": "overflow"}]},
                            {"type": "text", "text": "And now?"}]}],
                    "tools": [ADD], "tool_choice": {"type": "tool", "name": "add"}, "stop_sequences": ["END"],
                    "temperature": 0.5, "top_k": 5, "metadata": {"user_id": "u-1"}, "min_p": 0.2})
    calls = [{"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
             {"id": "toolu_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]
    assert t.chat.messages == [
        {"role": "system", "content": "Be brief.\nUse tools."}, {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: overflow"},
        {"role": "user", "content": "And now?"}]
    assert t.chat.tools == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers", "parameters": ADD["input_schema"]}}]
    assert t.chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert (t.chat.max_tokens, t.chat.stop, t.chat.temperature, t.chat.top_k) == (16, ["END"], 0.5, 5)
    assert (t.chat.user, t.chat.min_p) == ("u-1", 0.2)  # vLLM's extra sampling fields pass on
    assert not t.prefill and t.chat.add_generation_prompt


@pytest.mark.parametrize("choice, chat_choice, parallel", [
    ({"type": "auto"}, "auto", None), ({"type": "any"}, "required", None), ({"type": "none"}, "none", None),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
    ({"type": "tool", "name": "add"}, {"type": "function", "function": {"name": "add"}}, None)])
def test_tool_choices(choice, chat_choice, parallel):
    t = _translate({"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "tool_choice": choice})
    assert (t.chat.tool_choice, t.chat.parallel_tool_calls) == (chat_choice, parallel)
    tools = chat_tools(t.chat)
    assert tools.choice == (chat_choice if isinstance(chat_choice, str) else "named")
    assert tools.parallel is (parallel is not False)


def test_a_final_assistant_turn_is_a_prefill():
    t = _translate({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\n"}]})
    assert t.prefill and t.chat.continue_final_message and not t.chat.add_generation_prompt
    assert t.chat.messages[-1] == {"role": "assistant", "content": "<think>\n"}


def test_thinking_maps_onto_the_thinking_budget():
    msgs = {"messages": [{"role": "user", "content": "x"}]}
    enabled = _translate({**msgs, "thinking": {"type": "enabled", "budget_tokens": 64}}, True)
    assert enabled.chat.thinking_token_budget == 64
    assert _translate({**msgs, "thinking": {"type": "disabled"}}, True).chat.thinking_token_budget == 0
    assert _translate({**msgs, "thinking": {"type": "disabled"}}).chat.thinking_token_budget is None
    assert _translate({**msgs, "thinking": {"type": "adaptive"}}, True).chat.thinking_token_budget is None
    hidden = _translate({**msgs, "thinking": {"type": "enabled", "budget_tokens": 8, "display": "omitted"}}, True)
    assert hidden.chat.include_reasoning is False
    error = _error({**msgs, "thinking": {"type": "enabled", "budget_tokens": 64}})  # a model that cannot think
    assert error.status == 400 and error.param == "thinking" and "reasoning" in error.message


def test_output_config_format_and_count_tokens_requests():
    t = _translate({"messages": [{"role": "user", "content": "x"}],
                    "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}})
    assert t.chat.response_format.json_schema.json_schema == {"type": "object"}
    count = to_chat(CountTokensRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                       "tools": [ADD]}), False)
    assert count.chat.max_tokens is None and count.chat.tools[0]["function"]["name"] == "add"


@pytest.mark.parametrize("body, param", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0.type"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content.0.type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]},
     "messages.0.content.0.tool_use_id"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
     "messages.0.content"),
    ({"system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]}, "system.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "web_search_20250305", "name": "w"}]},
     "tools.0.type"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**ADD, "input_schema": {"type": "nonsense"}}]},
     "tools.0.input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**ADD, "input_schema": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}]}, "tools.0.input_schema"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{**ADD, "name": "bad name"}]}, "tools.0.name"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "tool_choice": {"type": "tool", "name": "f"}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "any"}}, "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"messages": [{"role": "user", "content": "x"}], "mcp_servers": [{"url": "x"}]}, "mcp_servers"),
    ({"messages": [{"role": "user", "content": "x"}], "output_config": {"format": {"type": "xml"}}},
     "output_config.format"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [ADD], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}, "tool_choice"),
])
def test_bad_input_names_the_anthropic_field(body, param):
    error = _error(body)
    assert error.status == 400 and error.param == param and error.message.startswith(param), error.message


# ---- the message and its events -----------------------------------------------------------------
def _out(text: str, finish: str | None = "stop", stop: int | str | None = None, tokens: int = 5) -> CompletionOutput:
    return CompletionOutput(0, text=text, token_ids=list(range(tokens)), finish_reason=finish, stop_reason=stop)


def _stream(parser_factory, pieces: list[str], out: CompletionOutput) -> tuple[list[dict], dict]:
    """The events of a streamed message and the whole message of the same text."""
    streamed = MessageBuilder("msg_1", "m", parser_factory(), 7)
    events = streamed.start()
    for i, piece in enumerate(pieces):
        events += streamed.feed(piece, final=i == len(pieces) - 1)
    events += streamed.finish(out)
    whole = MessageBuilder("msg_1", "m", parser_factory(), 7)
    whole.feed(out.text, final=True)
    whole.finish(out)
    return events, whole.message()


def _accumulate(events: list[dict]) -> dict:
    """What the SDK's stream helper makes of the events (each checked against the SDK's types)."""
    snapshot, bufs = None, {}
    for event in events:
        if event["type"] == "ping":
            continue
        typed = EVENTS.validate_python(json.loads(sse(event).split(b"data: ", 1)[1]))
        snapshot = accumulate_event(event=typed, current_snapshot=snapshot, json_bufs=bufs)
    return _plain(snapshot.to_dict())


def _plain(message: dict) -> dict:
    """A message without what differs between two builders (tool ids) or is unset (stop_details)."""
    message = {k: v for k, v in message.items() if not (k == "stop_details" and v is None)}
    return {**message, "content": [{**b, "id": "toolu"} if b["type"] == "tool_use" else b
                                   for b in message["content"]]}


def test_thinking_then_text_streams_to_the_whole_message():
    text = "<think>Two plus three.</think>It is 5."
    parser = lambda: ChoiceParser(ReasoningSplitter("<think>", "</think>", thinking=False), None, True)  # noqa: E731
    events, whole = _stream(parser, [text[i:i + 3] for i in range(0, len(text), 3)], _out(text))
    Message.model_validate(whole)
    assert [b["type"] for b in whole["content"]] == ["thinking", "text"]
    assert whole["content"][0] == {"type": "thinking", "thinking": "Two plus three.", "signature": ""}
    assert (whole["stop_reason"], whole["usage"]) == ("end_turn", {"input_tokens": 7, "output_tokens": 5})
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    deltas = {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"}
    assert deltas == {"thinking_delta", "text_delta"}
    assert _accumulate(events) == _plain(whole)


def test_forced_calls_stream_input_json_and_end_with_tool_use():
    args = '{"a":2,"b":3}'
    events, whole = _stream(lambda: ChoiceParser(None, NamedCallParser(name="add"), True),
                            [args[:4], args[4:9], args[9:]], _out(args))
    (block,) = whole["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and block["input"] == {"a": 2, "b": 3}
    assert whole["stop_reason"] == "tool_use"
    fragments = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert "".join(fragments) == args and len(fragments) == 3
    streamed = _accumulate(events)
    assert streamed["content"][0]["input"] == block["input"] and streamed["stop_reason"] == "tool_use"
    # `any`: several calls, one block each.
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "add", "parameters": {"a": 3, "b": 4}}]'
    events, whole = _stream(lambda: ChoiceParser(None, RequiredCallsParser(), True), [text[:30], text[30:]], _out(text))
    assert [b["input"] for b in whole["content"]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [b["input"] for b in _accumulate(events)["content"]] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]


def test_auto_calls_and_text_before_them():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
    events, whole = _stream(lambda: ChoiceParser(None, HermesParser({"add"}), True), [text[:20], text[20:]], _out(text))
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    assert whole["content"][0]["text"] == "Let me add." and whole["content"][1]["input"] == {"a": 1, "b": 2}
    assert whole["stop_reason"] == "tool_use" and _accumulate(events) == _plain(whole)


def test_a_cut_call_is_left_out_and_the_stop_reason_is_max_tokens():
    args = '{"a":2,"b'
    events, whole = _stream(lambda: ChoiceParser(None, NamedCallParser(name="add"), True), [args], _out(args, "length"))
    assert whole["content"] == [] and whole["stop_reason"] == "max_tokens"
    assert [e["type"] for e in events].count("content_block_start") == 1  # its fragments were streamed


def test_stop_sequences_and_plain_text():
    events, whole = _stream(lambda: None, ["Hello", " world"], _out("Hello world", stop="END"))
    assert whole["content"] == [{"type": "text", "text": "Hello world"}]
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("stop_sequence", "END")
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert events[-2]["usage"] == {"output_tokens": 5}
    _, eos = _stream(lambda: None, ["Hi"], _out("Hi", stop=2))  # a stop token id is a natural end
    assert (eos["stop_reason"], eos["stop_sequence"]) == ("end_turn", None)
    _, empty = _stream(lambda: None, [""], _out("", tokens=1))
    assert empty["content"] == [] and Message.model_validate(empty)
    assert sse({"type": "ping"}) == b'event: ping\ndata: {"type":"ping"}\n\n'
    with pytest.raises(OpenAIError):  # an aborted request is not an answer
        MessageBuilder("msg_1", "m", None, 1).finish(_out("x", "abort"))


def test_error_shape_and_status():
    assert error_body(OpenAIError(400, "bad")) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                               "message": "bad"}}
    busy = retry_later("the engine is overloaded")
    assert (error_status(busy), error_body(busy)["error"]["type"]) == (529, "overloaded_error")
    down = OpenAIError(503, "the engine is unavailable")
    assert (error_status(down), error_body(down)["error"]["type"]) == (503, "overloaded_error")
    for status, kind in ((401, "authentication_error"), (404, "not_found_error"), (500, "api_error")):
        assert error_body(OpenAIError(status, "x"))["error"]["type"] == kind
