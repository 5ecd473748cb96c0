"""The Responses API without Ray: input items onto the chat path, the response object and its
events (validated by the OpenAI SDK's own types and its stream accumulator), cut calls, the
SQLite store and its retention. tests/actors/smollm2_apis/test_responses.py serves it end to end."""
import asyncio
import json
import time

import pytest
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from actors.http.chat_parsers import ChoiceParser
from actors.http.openai_protocol import OpenAIError, chat_params, chat_tools
from actors.http.reasoning_parser import ReasoningSplitter
from actors.http.responses import ResponsesRequest, items_to_messages, to_chat, translate_error
from actors.http.responses_api import ResponsesAPI
from actors.http.responses_format import ResponseBuilder, response_usage
from actors.http.tool_parser import MAX_PARALLEL_TOOL_CALLS, RequiredCallsParser, tool_request
from actors.store.base import ResponseStoreConfig, StoredResponse
from actors.store.sqlite import SQLiteResponseStore

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

EVENTS = TypeAdapter(ResponseStreamEvent)
ADD = {"type": "function", "name": "add", "description": "Add two integers", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}


def _translate(body: dict, context=(), reasoning=False):
    req = ResponsesRequest.model_validate(body)
    return to_chat(req, list(context), reasoning)


# ---- input items -> chat ------------------------------------------------------------------
def test_items_become_the_chat_conversation():
    t = _translate({"instructions": "Be brief.", "input": [
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "2+3?"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]},
        {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": '{"a": 1, "b": 1}'},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "2"}]}],
        "tools": [ADD], "tool_choice": {"type": "function", "name": "add"}, "max_output_tokens": 7,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}, "top_k": 5})
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}},
             {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}]
    assert t.chat.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "2+3?"}, {"role": "assistant", "content": "Let me add.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
        {"role": "tool", "tool_call_id": "call_2", "content": "2"}]
    assert t.chat.tools == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers", "parameters": ADD["parameters"]}}]
    assert t.chat.tool_choice == {"type": "function", "function": {"name": "add"}}
    assert (t.chat.max_completion_tokens, t.chat.top_k) == (7, 5)  # vLLM's extra sampling fields pass on
    assert t.chat.response_format.json_schema.json_schema == {"type": "object"}
    assert all(item["id"] for item in t.input_items) and len(t.input_items) == 8
    assert t.input_items[1]["content"] == [{"type": "input_text", "text": "2+3?"}]


def test_a_string_input_and_a_stored_context_render_like_a_resent_conversation():
    first = _translate({"input": "Hi"}).input_items
    answer = {"type": "message", "id": "msg_a", "role": "assistant", "status": "completed",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]}
    chained = _translate({"input": "Again"}, context=[*first, answer])
    resent = _translate({"input": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                                   {"role": "user", "content": "Again"}]})
    assert chained.chat.messages == resent.chat.messages == [
        {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Again"}]
    assert items_to_messages([], "sys") == [{"role": "system", "content": "sys"}]


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [ADD], "tool_choice": {"type": "allowed_tools", "tools": []}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning.effort"),  # no reasoning parser
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({}, "input"),
])
def test_bad_input_is_400_naming_the_field(body, param):
    with pytest.raises(OpenAIError) as info:
        _translate(body)
    assert info.value.status == 400 and info.value.param == param and param in info.value.message


def test_chat_path_errors_name_the_responses_field():
    bad = {**ADD, "parameters": {"type": "nonsense"}}
    with pytest.raises(OpenAIError) as info:
        try:
            chat_tools(_translate({"input": "x", "tools": [bad]}).chat)
        except OpenAIError as exc:
            raise translate_error(exc)
    assert info.value.param == "tools[0].parameters" and info.value.message.startswith("tools[0].parameters")


def test_reasoning_effort_becomes_a_thinking_budget():
    t = _translate({"input": "x", "reasoning": {"effort": "low"}}, reasoning=True)
    assert t.chat.thinking_token_budget == 512 and t.effort == "low"


def test_required_tools_grammar_is_bounded():
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD["parameters"]}}]
    assert tool_request(tools, "required").constraint().json["maxItems"] == MAX_PARALLEL_TOOL_CALLS
    assert tool_request(tools, "required", parallel_tool_calls=False).constraint().json["maxItems"] == 1
    for parallel, most in ((None, MAX_PARALLEL_TOOL_CALLS), (False, 1)):  # Responses' tools reach the same grammar
        body = {"input": "x", "tools": [ADD], "tool_choice": "required", "parallel_tool_calls": parallel}
        chat = _translate(body).chat
        assert chat_params(chat, chat_tools(chat)).structured_outputs.json["maxItems"] == most


# ---- the response object and its events ----------------------------------------------------
BASE = {"model": "m", "instructions": None, "max_output_tokens": None, "max_tool_calls": None, "metadata": {},
        "parallel_tool_calls": True, "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
        "store": True, "temperature": 1.0, "text": {"format": {"type": "text"}, "verbosity": "medium"},
        "tool_choice": "auto", "tools": [ADD], "top_p": 1.0, "top_logprobs": 0, "truncation": "disabled",
        "user": None, "background": False, "service_tier": "default"}


def _run(parser, pieces, finish_reason):
    """Events of one generation fed in `pieces`, then the final response (as the ingress does)."""
    builder = ResponseBuilder("resp_1", BASE, parser)
    events = builder.start()
    for i, piece in enumerate(pieces):
        events += builder.feed(piece, final=i == len(pieces) - 1)
    events += builder.finish(finish_reason)
    final = builder.response(builder.final_status(finish_reason), response_usage(10, 5, 0, 0))
    return events + [builder.terminal(final)], final


def _sdk_accumulates(events, final):
    """Every event validates as the SDK's typed event; the SDK's stream state accepts the
    sequence and ends on the same response; sequence numbers count from 0."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    state = ResponseStreamState(input_tools=[ADD], text_format=omit)
    for raw in events:
        event = EVENTS.validate_python(json.loads(json.dumps(raw)))
        assert event.type == raw["type"]
        state.handle_event(event)
    Response.model_validate(final)
    return state


def test_text_and_reasoning_items_stream_and_add_up():
    make = lambda: ChoiceParser(ReasoningSplitter("<think>", "</think>", thinking=False), None, True)  # noqa: E731
    text = "<think>add them</think>The sum is 5."
    events, final = _run(make(), [text[i:i + 3] for i in range(0, len(text), 3)], "stop")
    whole_events, whole = _run(make(), [text], "stop")
    _sdk_accumulates(events, final)
    strip = lambda r: [{k: v for k, v in i.items() if k != "id"} for i in r["output"]]  # noqa: E731
    assert strip(final) == strip(whole)
    reasoning, message = final["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "add them"}]
    assert message["content"][0]["text"] == "The sum is 5." and final["status"] == "completed"
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "The sum is 5."
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == "add them"
    assert Response.model_validate(final).output_text == "The sum is 5."


def test_a_call_cut_by_the_token_limit_is_not_returned():
    text = '[{"name": "add", "parameters": {"a": 2, "b": 3}}, {"name": "add", "parameters": {"a": 2, "b'
    parser = ChoiceParser(None, RequiredCallsParser(), True)
    events, final = _run(parser, [text[:30], text[30:60], text[60:]], "length")
    _sdk_accumulates(events, final)
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    (call,) = final["output"]
    assert (call["name"], json.loads(call["arguments"]), call["status"]) == ("add", {"a": 2, "b": 3}, "completed")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [i["status"] for i in done] == ["completed", "incomplete"]  # the cut one is marked so
    assert len([e for e in events if e["type"] == "response.function_call_arguments.done"]) == 1
    # Chat Completions: the cut call is left out of the non-streamed message.
    message = ChoiceParser(None, RequiredCallsParser(), True).message(text)
    assert [json.loads(c["function"]["arguments"]) for c in message["tool_calls"]] == [{"a": 2, "b": 3}]
    cut = ChoiceParser(None, RequiredCallsParser(), True).message(text[:40])  # inside the first call
    assert "tool_calls" not in cut and cut["content"] is None


def test_an_empty_answer_still_has_a_message():
    events, final = _run(None, [""], "stop")
    _sdk_accumulates(events, final)
    assert [i["type"] for i in final["output"]] == ["message"] and Response.model_validate(final).output_text == ""


# ---- the store -------------------------------------------------------------------------------
def _record(i: int, created_at: float) -> StoredResponse:
    return StoredResponse(f"resp_{i}", created_at, {"id": f"resp_{i}", "output": [{"id": f"msg_{i}"}]},
                          [{"id": f"in_{i}"}], [{"id": f"ctx_{i}"}])


def test_sqlite_store_keeps_records_across_reopening_and_applies_retention(tmp_path):
    config = ResponseStoreConfig(directory=str(tmp_path), max_responses=3, max_age_s=3600)
    store = SQLiteResponseStore(config)
    now = time.time()
    for i in range(5):
        store.put(_record(i, now + i))
    assert store.count() == 3 and store.get("resp_0") is None and store.get("resp_1") is None  # oldest went first
    got = store.get("resp_4")
    assert got.conversation() == [{"id": "ctx_4"}, {"id": "in_4"}, {"id": "msg_4"}]
    assert store.delete("resp_4") and not store.delete("resp_4") and store.get("resp_4") is None
    store.put(_record(9, now - 7200))  # older than max_age_s: never returned, pruned at the next write
    assert store.get("resp_9") is None
    store.close()
    reopened = SQLiteResponseStore(config)  # a restart: the records are still there
    assert reopened.get("resp_3").response["id"] == "resp_3" and reopened.count() == 2
    reopened.close()


def test_previous_response_id_without_a_store_is_400_and_unknown_is_404():
    api = ResponsesAPI(None)
    with pytest.raises(OpenAIError) as info:
        asyncio.run(api._previous("resp_x"))
    assert info.value.status == 400 and info.value.param == "previous_response_id"
    with pytest.raises(OpenAIError) as info:
        asyncio.run(api.retrieve("resp_x"))
    assert info.value.status == 404

    class Empty:  # a store that knows nothing
        class get:
            @staticmethod
            def remote(_):
                async def none():
                    return None
                return none()

    with pytest.raises(OpenAIError) as info:
        asyncio.run(ResponsesAPI(Empty())._previous("resp_x"))
    assert info.value.status == 404 and "resp_x" in info.value.message


def test_the_deploy_args_wire_one_store_behind_the_ingress(tmp_path):
    from pydantic import ValidationError
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    from actors.app import AppArgs, build_app

    app = call_user_app_builder_with_args_if_necessary(build_app, {
        "preset": "smollm2-cpu-small", "ingress_replicas": 2,
        "response_store": {"directory": str(tmp_path), "max_age_s": 60, "resources": {"head": 0.1}}})
    ingress = app._bound_deployment
    store = ingress.init_kwargs["response_store"]._bound_deployment
    assert (store.name, store.num_replicas) == ("response-store", 1)
    assert store._replica_config.ray_actor_options["resources"] == {"head": 0.1}
    assert ResponseStoreConfig.model_validate(store.init_args[0]).resolved_directory() == tmp_path
    off = call_user_app_builder_with_args_if_necessary(build_app, {"preset": "smollm2-cpu-small",
                                                                   "response_store": {"enabled": False}})
    assert off._bound_deployment.init_kwargs["response_store"] is None
    with pytest.raises(ValidationError, match="max_responses"):
        AppArgs(response_store={"max_responses": 0})
    with pytest.raises(ValidationError, match="unknown_key"):
        AppArgs(response_store={"unknown_key": 1})
