"""Anthropic's Messages API end to end: `serve run` of a deploy file (through `actors.serve_cli`) as
a subprocess on loopback, driven by the real `anthropic` SDK through `base_url`, unmodified.

The package's one Serve app (server.py): SmolLM2 on CPU in fp32, vLLM's `qwen3` reasoning parser
(<think> ... </think>) and the `hermes` tool-call parser, an API key.
tests/actors/test_anthropic_protocol.py checks the conversion and the events without a server.
"""
import json

import anthropic
import jsonschema
import openai
import pytest
import requests

from ray_helpers import fuzz_openapi, wait_for

from .server import API_KEY, MODEL, wait_idle

AUTH = {"x-api-key": API_KEY}
# The SDK's create() takes no sampling fields any more (temperature, top_p, top_k): the API does.
GREEDY = {"temperature": 0}
ADD = {"name": "add", "description": "Add two integers and return the sum.",
       "input_schema": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                        "required": ["a", "b"], "additionalProperties": False}}
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0, timeout=300)


def _plain(message) -> dict:
    """A message as a dict, without what differs between two answers (ids)."""
    out = message.to_dict()
    out.pop("id")
    out.pop("stop_details", None)
    out["content"] = [{**b, "id": "toolu"} if b["type"] == "tool_use" else b for b in out["content"]]
    return out


# ---- messages, whole and streamed -------------------------------------------------------------
def test_a_message_whole_streamed_and_on_the_chat_path(client, server):
    kwargs = dict(model=MODEL, max_tokens=32, extra_body=GREEDY, system="Answer in one line.",
                  messages=[{"role": "user", "content": "Name three colors of the rainbow."}],
                  metadata={"user_id": "u-1"})
    whole = client.messages.create(**kwargs)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason in ("end_turn", "max_tokens") and whole.stop_sequence is None
    assert whole.usage.input_tokens > 0 and 0 < whole.usage.output_tokens <= 32
    # The SDK's stream helper accumulates the events into the same message.
    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.id != whole.id and _plain(final) == _plain(whole) and text == whole.content[0].text
    kinds = [e.type for e in client.messages.create(stream=True, **kwargs)]
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    # It is the chat path: the same conversation as a chat completion answers the same.
    chat = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=32, temperature=0, messages=[{"role": "system", "content": kwargs["system"]},
                                                             *kwargs["messages"]])
    assert chat.choices[0].message.content == whole.content[0].text
    assert chat.usage.prompt_tokens == whole.usage.input_tokens


def test_sse_lines_and_authentication(server, client):
    body = {"model": MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
    for headers in (AUTH, {"Authorization": f"Bearer {API_KEY}"}):  # the SDK's header, and the OpenAI one
        with requests.post(server.base + "/v1/messages", json=body, headers=headers, stream=True, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            raw = r.content.decode()
        events = [e for e in raw.split("\n\n") if e]
        for event in events:
            kind, data = event.split("\n")
            assert kind.startswith("event: ") and data.startswith("data: ")
            assert json.loads(data[len("data: "):])["type"] == kind[len("event: "):]
        assert events[0].startswith("event: message_start") and events[-1].startswith("event: message_stop")
    assert anthropic.Anthropic(base_url=server.base, auth_token=API_KEY, max_retries=0).messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}]).content is not None
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert info.value.body["type"] == "error" and info.value.body["error"]["type"] == "authentication_error"


# ---- tools ----------------------------------------------------------------------------------------
def test_a_tool_call_and_its_result_over_two_turns(client, server):
    question = {"role": "user", "content": "What is 2 plus 3? Use the add tool."}
    first = client.messages.create(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[ADD], messages=[question],
                                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert first.stop_reason == "tool_use"
    (call,) = first.content  # exactly one call
    assert call.type == "tool_use" and call.name == "add" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, ADD["input_schema"])
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                           "content": str(call.input["a"] + call.input["b"])}]}
    second = client.messages.create(model=MODEL, max_tokens=30, extra_body=GREEDY, tools=[ADD],
                                    tool_choice={"type": "none"},
                                    messages=[question, {"role": "assistant", "content": first.content}, result])
    assert [b.type for b in second.content] == ["text"] and second.content[0].text.strip()
    assert second.stop_reason in ("end_turn", "max_tokens")
    # The chat route, given the same conversation, answers the same.
    calls = [{"id": call.id, "type": "function", "function": {"name": "add", "arguments": json.dumps(call.input)}}]
    chat = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, tool_choice="none",
        tools=[{"type": "function", "function": {"name": "add", "description": ADD["description"],
                                                 "parameters": ADD["input_schema"]}}],
        messages=[question, {"role": "assistant", "content": None, "tool_calls": calls},
                  {"role": "tool", "tool_call_id": call.id, "content": result["content"][0]["content"]}])
    assert chat.choices[0].message.content == second.content[0].text


def test_a_forced_tool_whole_and_streamed(client):
    kwargs = dict(model=MODEL, max_tokens=60, extra_body=GREEDY, tools=[ADD, WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": "Is it raining in Lisbon?"}])
    whole = client.messages.create(**kwargs)
    (call,) = whole.content
    assert call.type == "tool_use" and call.name == "get_weather" and whole.stop_reason == "tool_use"
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert _plain(final) == _plain(whole)
    fragments = [e.delta.partial_json for e in events if e.type == "content_block_delta"]
    assert len(fragments) > 1 and json.loads("".join(fragments)) == call.input


# ---- stop sequences, thinking, counting --------------------------------------------------------
def test_a_stop_sequence_ends_the_answer(client):
    kwargs = dict(model=MODEL, max_tokens=40, extra_body=GREEDY,
                  messages=[{"role": "user", "content": "Count from one to twenty in words."}])
    free = client.messages.create(**kwargs).content[0].text
    words = free.split()
    assert len(words) > 4, free
    stop = words[3]
    cut = client.messages.create(stop_sequences=[stop, "never-written"], **kwargs)
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].text == free[:free.index(stop)]
    with client.messages.stream(stop_sequences=[stop], **kwargs) as stream:
        assert _plain(stream.get_final_message()) == _plain(cut)


def test_thinking_with_a_budget(client, server):
    # A prefill that opens a thinking block: the answer starts inside it; the budget ends it.
    kwargs = dict(model=MODEL, max_tokens=30, extra_body=GREEDY, thinking={"type": "enabled", "budget_tokens": 6},
                  messages=[{"role": "user", "content": "Describe a person in one sentence."},
                            {"role": "assistant", "content": "<think>\n"}])
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"], whole.content
    thinking, text = whole.content
    assert thinking.thinking and thinking.signature == "" and "</think>" not in thinking.thinking + text.text
    with client.messages.stream(**kwargs) as stream:
        kinds = {e.delta.type for e in stream if e.type == "content_block_delta"}
        final = stream.get_final_message()
    assert kinds == {"thinking_delta", "text_delta"} and _plain(final) == _plain(whole)
    chat = openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0).chat.completions.create(
        model=MODEL, max_tokens=30, temperature=0, messages=kwargs["messages"],
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "thinking_token_budget": 6})
    assert (chat.choices[0].message.reasoning_content, chat.choices[0].message.content) == (thinking.thinking,
                                                                                             text.text)
    hidden = client.messages.create(**{**kwargs, "thinking": {"type": "enabled", "budget_tokens": 6,
                                                               "display": "omitted"}})
    assert [b.type for b in hidden.content] == ["text"] and hidden.content[0].text == text.text


def test_count_tokens_is_the_prompt_the_message_runs(client):
    messages = [{"role": "user", "content": "What is 2 plus 3?"}]
    plain = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    ran = client.messages.create(model=MODEL, max_tokens=1, messages=messages, system="Be brief.")
    assert plain.input_tokens == ran.usage.input_tokens > 0
    with_tools = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.", tools=[ADD])
    ran = client.messages.create(model=MODEL, max_tokens=1, messages=messages, system="Be brief.", tools=[ADD])
    assert with_tools.input_tokens == ran.usage.input_tokens > plain.input_tokens  # the tool prompt counts
    unused = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.", tools=[ADD],
                                          tool_choice={"type": "none"})
    assert unused.input_tokens == plain.input_tokens  # `none`: tools are not rendered


# ---- errors and the engine ---------------------------------------------------------------------
USER = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize("body, status, kind, words, count_status", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     400, "invalid_request_error", "image", 400),
    ({"max_tokens": None, "messages": USER}, 400, "invalid_request_error", "max_tokens", 200),
    ({"max_tokens": 100000, "messages": USER}, 400, "invalid_request_error", "max_tokens", 200),
    ({"temperature": 1.5, "messages": USER}, 400, "invalid_request_error", "temperature", 200),
    ({"model": "claude-unknown", "messages": USER}, 404, "not_found_error", "claude-unknown", 404),
    ({"messages": USER, "tools": [{**ADD, "input_schema": {"type": "object",
                                                           "properties": {"a": {"type": "nonsense"}}}}]},
     400, "invalid_request_error", "tools.0.input_schema", 400),
    ({"messages": USER, "tools": [ADD], "tool_choice": {"type": "tool", "name": "nope"}}, 400,
     "invalid_request_error", "nope", 400),
    ("{not json", 400, "invalid_request_error", "JSON", 400),
])
def test_bad_input_is_anthropic_shaped_and_leaves_nothing_in_the_engine(server, engine, body, status, kind, words,
                                                                       count_status):
    """count_tokens refuses the same prompts; sampling fields mean nothing to it."""
    before = wait_idle(engine)
    data = body if isinstance(body, str) else json.dumps({"model": MODEL, "max_tokens": 8, **body})
    for path, expected in (("/v1/messages", status), ("/v1/messages/count_tokens", count_status)):
        r = requests.post(server.base + path, data=data, timeout=60,
                          headers={**AUTH, "content-type": "application/json"})
        assert r.status_code == expected, (path, r.text)
        if expected != 200:
            error = r.json()
            assert error["type"] == "error" and error["error"]["type"] == kind and words in error["error"]["message"]
    after = engine()
    assert after["num_unfinished"] == 0 and after["num_free_blocks"] == after["num_blocks"]
    for counter in ("generation_tokens", "prompt_tokens"):
        assert after[counter] == before[counter], counter


def test_sdk_errors_are_typed(client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               thinking={"type": "enabled", "budget_tokens": 0})
    assert info.value.body["error"]["type"] == "invalid_request_error" and "budget_tokens" in info.value.message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-unknown", messages=[{"role": "user", "content": "x"}])


def test_client_disconnect_aborts_and_frees_blocks(server, engine):
    idle = wait_idle(engine)
    body = {"model": MODEL, "max_tokens": 400, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    with requests.post(server.base + "/v1/messages", json=body, headers=AUTH, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        deltas = 0
        while deltas < 3:
            deltas += next(lines) == b"event: content_block_delta"
        assert engine()["running"] == 1
    after = wait_idle(engine)
    assert after["num_free_blocks"] == after["num_blocks"] == idle["num_free_blocks"]
    assert after["generation_tokens"] - idle["generation_tokens"] < 400


def test_openapi_documents_the_routes_and_fuzzing_finds_no_server_error(server, engine, tmp_path):
    spec = requests.get(server.base + "/openapi.json", timeout=30).json()
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        op = spec["paths"][path]["post"]
        assert {"400", "401", "404", "503", "529"} <= set(op["responses"]) and "422" not in op["responses"]
        assert "messages" in op["requestBody"]["content"]["application/json"]["schema"]["required"]
    assert fuzz_openapi(server.base, tmp_path, f"x-api-key: {API_KEY}", 20, 7, "--include-path-regex", "^/v1/messages",
                        timeout=600) >= 20
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 120, "the fuzz requests to finish")
    assert after["num_free_blocks"] == after["num_blocks"]
