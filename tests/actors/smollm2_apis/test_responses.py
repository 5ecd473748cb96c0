"""The Responses API and its durable store end to end: `serve run` of a deploy file (through
`actors.serve_cli`) as a subprocess on loopback, driven by the real `openai` SDK and by agent /
structured-output libraries as their own docs use them.

The package's one Serve app (server.py): SmolLM2 on CPU in fp32, two ingress replicas sharing one
`response-store`, whose SQLite file lives in the test's temporary directory. The last test stops
`serve run` and starts it again on the same store (the package's last test: module order).
"""
import asyncio
import json

import jsonschema
import openai
import pytest

from actors.http.tool_parser import MAX_PARALLEL_TOOL_CALLS

from .server import API_KEY, BLOCK, MODEL, wait_idle

ADD = {"type": "function", "name": "add", "description": "Add two integers and return the sum.",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}, "strict": True}
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 20},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"]}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


# ---- the OpenAI SDK ---------------------------------------------------------------------------
def test_create_whole_and_streamed_with_typed_events(client):
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    kwargs = dict(model=MODEL, input="Name three colors of the rainbow.", instructions="Answer in one line.",
                  max_output_tokens=48, temperature=0, metadata={"case": "basic"}, user="u-1",
                  reasoning={"effort": "low"})  # a thinking budget (the model does not think here)
    whole = client.responses.create(**kwargs)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.output_text
    assert whole.status == "completed" and (whole.metadata, whole.user) == ({"case": "basic"}, "u-1")
    assert whole.reasoning.effort == "low" and whole.store
    assert whole.usage.input_tokens > 0 and whole.usage.output_tokens > 0
    assert whole.usage.output_tokens_details.reasoning_tokens == 0  # the model does not think here
    events = list(client.responses.create(stream=True, **kwargs))
    strict = TypeAdapter(ResponseStreamEvent)
    for event in events:  # the SDK's typed classes, each passing its own validation
        assert type(strict.validate_python(event.to_dict())) is type(event), event.type
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert events[-1].response.output_text == whole.output_text
    # The SDK's stream helper accumulates the same events into the final response.
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.id != whole.id


def test_function_call_round_trip(client):
    first = client.responses.create(model=MODEL, input="What is 2 plus 3? Use the add tool.", tools=[ADD],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=60,
                                    temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]  # exactly one call
    assert call.name == "add" and call.call_id.startswith("call_") and call.status == "completed"
    args = json.loads(call.arguments)
    jsonschema.validate(args, ADD["parameters"])
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[ADD], tool_choice="none", max_output_tokens=30,
        temperature=0, input=[{"type": "function_call_output", "call_id": call.call_id,
                               "output": str(args["a"] + args["b"])}])
    assert second.output_text.strip() and second.previous_response_id == first.id
    assert [i.type for i in second.output] == ["message"]
    # The same conversation re-sent whole (the call and its output as items) answers the same.
    resent = client.responses.create(
        model=MODEL, tools=[ADD], tool_choice="none", max_output_tokens=30, temperature=0,
        input=[{"role": "user", "content": "What is 2 plus 3? Use the add tool."},
               {"type": "function_call", "call_id": call.call_id, "name": "add", "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id, "output": str(args["a"] + args["b"])}])
    assert resent.output_text == second.output_text


def test_json_schema_text_format_validates(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="Describe a person as JSON with name and age.",
                                  max_output_tokens=60, temperature=0,
                                  text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                   "strict": True}})
    assert out.status == "completed" and out.text.format.type == "json_schema"
    jsonschema.validate(json.loads(out.output_text), schema)


def test_chain_matches_the_whole_conversation_and_hits_the_prefix_cache(client, server):
    turns = ["Hi! What is the capital of France?", "And of Italy?", "Which of the two is larger?"]
    chain, previous = [], None
    for text in turns:
        r = client.responses.create(model=MODEL, input=text, previous_response_id=previous, max_output_tokens=24,
                                    temperature=0)
        chain.append(r)
        previous = r.id
    for before, after in zip(chain, chain[1:]):
        # The earlier turn (prompt and answer) is laid out first again: its whole blocks are cache
        # hits. The answer's last token was never fed back, so its KV was not computed.
        earlier = before.usage.input_tokens + before.usage.output_tokens - 1
        cached = after.usage.input_tokens_details.cached_tokens
        assert cached >= earlier // BLOCK * BLOCK > 0, (before.usage, after.usage)
    history = []
    for text, r in zip(turns, chain):
        history.append({"role": "user", "content": text})
        whole = client.responses.create(model=MODEL, input=history, max_output_tokens=24, temperature=0)
        assert whole.output_text == r.output_text
        history.append({"role": "assistant", "content": r.output_text})
    # Stored: retrievable, its input items listed (earlier turns' too), deletable.
    got = client.responses.retrieve(chain[2].id)
    assert got.id == chain[2].id and got.output_text == chain[2].output_text
    items = client.responses.input_items.list(chain[2].id, order="asc")
    assert [i.type for i in items.data] == ["message"] * 5
    assert [i.role for i in items.data] == ["user", "assistant", "user", "assistant", "user"]
    assert items.data[-1].content[0].text == turns[2]
    page = client.responses.input_items.list(chain[2].id, limit=2)  # newest first
    assert [i.id for i in page.data] == [i.id for i in reversed(items.data)][:2] and page.has_more
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):  # store: false wrote nothing
        client.responses.retrieve(unstored.id)
    server.chain = [r.id for r in chain]  # the restart test continues it


def test_two_ingress_replicas_share_one_store(client, server):
    r = server.post("/v1/responses", timeout=120, json={
        "model": MODEL, "input": "Say hi.", "max_output_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    writer = r.headers["x-llm-cluster-replica"]
    readers = set()
    for _ in range(40):  # the proxy spreads requests over both replicas; bounded
        got = server.get(f"/v1/responses/{r.json()['id']}", timeout=30)
        assert got.status_code == 200 and got.json()["output"] == r.json()["output"]
        readers.add(got.headers["x-llm-cluster-replica"])
        if readers - {writer}:
            break
    assert readers - {writer}, "every read went to the replica that wrote"


SCORES = {"type": "function", "name": "record_scores", "description": "Record eight test scores.",
          "parameters": {"type": "object", "additionalProperties": False, "required": [f"s{i}" for i in range(8)],
                         "properties": {f"s{i}": {"type": "integer"} for i in range(8)}}}


def test_one_call_when_parallel_calls_are_off_and_cut_calls_are_not_returned(client):
    one = client.responses.create(model=MODEL, input="Add 2 and 3, then add 4 and 5.", tools=[ADD],
                                  tool_choice="required", parallel_tool_calls=False, max_output_tokens=80,
                                  temperature=0)
    assert [i.type for i in one.output] == ["function_call"] and one.status == "completed"
    # With parallel calls this model repeats the call; the list still ends, bounded, every call whole.
    many = client.responses.create(model=MODEL, input="What is 2 plus 3?", tools=[ADD], tool_choice="required",
                                   max_output_tokens=240, temperature=0)
    calls = [i for i in many.output if i.type == "function_call"]
    assert many.status == "completed" and 1 <= len(calls) <= MAX_PARALLEL_TOOL_CALLS
    assert all(json.loads(c.arguments) == {"a": 2, "b": 3} for c in calls)
    # Eight required integers take far more than 24 tokens: the limit falls inside the first call.
    kwargs = dict(model=MODEL, input="Record the scores 90, 85, 70, 60, 95, 88, 77 and 66.", tools=[SCORES],
                  tool_choice="required", temperature=0)
    cut = client.responses.create(max_output_tokens=24, **kwargs)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert all(json.loads(i.arguments) is not None for i in cut.output if i.type == "function_call")
    assert not [i for i in cut.output if i.type == "function_call"]
    events = list(client.responses.create(max_output_tokens=24, stream=True, **kwargs))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.status for i in done if i.type == "function_call"][-1] == "incomplete"
    assert events[-1].type == "response.incomplete" and not [
        i for i in events[-1].response.output if i.type == "function_call" and i.status != "completed"]
    # Chat Completions: the same cut call is left out; finish_reason says the answer was cut.
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": kwargs["input"]}], max_tokens=24, temperature=0,
        tools=[{"type": "function", "function": {k: SCORES[k] for k in ("name", "description", "parameters")}}],
        tool_choice="required").choices[0]
    assert chat.finish_reason == "length" and not chat.message.tool_calls


TOOL_SETS = [[ADD], [WEATHER], [ADD, WEATHER]]
PROMPTS = ["What is 17 plus 25?", "Is it raining in Lisbon?", "I need the weather in Oslo and the sum of 1 and 2."]


def test_every_returned_call_parses_and_validates(server):
    """Fuzz: tool sets x prompts x tool choices, all at once; every call the server returns must
    parse and validate against its tool's parameters, whatever the model did."""
    params = {t["name"]: t["parameters"] for t in (ADD, WEATHER)}
    aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=600)

    async def one(tools, prompt, choice, limit):
        r = await aclient.responses.create(model=MODEL, input=prompt, tools=tools, tool_choice=choice,
                                           max_output_tokens=limit, temperature=0, store=False)
        return [(i.name, i.arguments, i.status) for i in r.output if i.type == "function_call"]

    async def run():
        try:
            cases = [(tools, prompt, "required", 64) for tools in TOOL_SETS for prompt in PROMPTS]
            cases += [(tools, PROMPTS[2], "auto", 40) for tools in TOOL_SETS]
            return cases, await asyncio.gather(*[one(*c) for c in cases])
        finally:
            await aclient.close()

    cases, results = asyncio.run(run())
    made = 0
    for case, calls in zip(cases, results):
        for name, arguments, status in calls:
            assert status == "completed" and name in {t["name"] for t in case[0]}, case
            jsonschema.validate(json.loads(arguments), params[name])
            made += 1
        if case[2] == "required":
            assert calls, case  # a required choice makes a call (cut ones aside: 64 tokens hold one)
    assert made >= len(TOOL_SETS) * len(PROMPTS)


# ---- errors, the tokenizer routes, disconnects ------------------------------------------------
@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "previous_response_id"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, 400, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": "x", "tools": [{**ADD, "parameters": {"type": "nonsense"}}]}, 400, "tools[0].parameters"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, 400, "tools[0].type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, 400, "text.format.schema"),
])
def test_bad_input_is_openai_shaped_and_queues_nothing(server, engine, body, status, param):
    before = wait_idle(engine)
    r = server.post("/v1/responses", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["code"] == status
    after = engine()
    for counter in ("generation_tokens", "prompt_tokens"):
        assert after[counter] == before[counter], counter


def test_tokenize_and_detokenize_in_vllm_shape(server):
    r = server.post("/tokenize", timeout=30, json={"model": MODEL, "prompt": "Hello world",
                                                                   "return_token_strs": True}).json()
    assert r["count"] == len(r["tokens"]) == len(r["token_strs"]) and r["max_model_len"] == 1024
    assert "".join(r["token_strs"]).replace("Ġ", " ") == "Hello world"
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    cont = server.post("/tokenize", timeout=30, json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": False}).json()
    back = server.post("/detokenize", timeout=30, json={"tokens": cont["tokens"]}).json()
    assert back["prompt"].endswith("Hel")  # the last message left open
    tools = server.post("/tokenize", timeout=30, json={
        "messages": messages[:1], "tools": [{"type": "function", "function": {"name": "add"}}]}).json()
    assert tools["count"] > cont["count"]  # the tool listing is rendered
    bad = server.post("/tokenize", timeout=30, json={
        "messages": messages, "continue_final_message": True, "add_generation_prompt": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_client_disconnect_aborts_and_frees_blocks(server, engine):
    idle = wait_idle(engine)
    body = {"model": MODEL, "input": "Tell me a long story.", "max_output_tokens": 400, "stream": True,
            "ignore_eos": True, "store": False}
    with server.post("/v1/responses", json=body, stream=True, timeout=120) as r:
        lines = r.iter_lines()
        deltas = 0
        while deltas < 3:
            deltas += next(lines).startswith(b"event: response.output_text.delta")
        assert engine()["running"] == 1
    after = wait_idle(engine)
    assert after["num_free_blocks"] == after["num_blocks"] == idle["num_free_blocks"]
    assert after["generation_tokens"] - idle["generation_tokens"] < 400


# ---- client libraries, installed as users install them -----------------------------------------
@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_openai_agents_runs_an_agent_with_a_function_tool(server, client, api):
    from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner,
                        function_tool, set_tracing_disabled)

    set_tracing_disabled(True)  # no trace export: the test talks to loopback only
    aclient = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    model = (OpenAIResponsesModel(model=MODEL, openai_client=aclient) if api == "responses"
             else OpenAIChatCompletionsModel(model=MODEL, openai_client=aclient))
    calls = []

    @function_tool
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        calls.append((a, b))
        return a + b

    # The small model would not call a tool by itself: the first turn requires one; the SDK then
    # resets tool_choice, and the model answers in text from the tool's output.
    agent = Agent(name="calculator", instructions="Use the add tool, then state the result.", tools=[add],
                  model=model, model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                                            temperature=0, max_tokens=80))
    # Over the Responses API the second turn continues the first through the store
    # (previous_response_id: only the tool's output is sent).
    result = Runner.run_sync(agent, "What is 2 plus 3?", max_turns=4, auto_previous_response_id=api == "responses")
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert len(calls) == 1 and str(sum(calls[0])) in result.final_output, (calls, result.final_output)
    if api == "responses":
        first, last = (r.response_id for r in result.raw_responses)
        assert client.responses.retrieve(last).previous_response_id == first
    asyncio.run(aclient.close())


def test_instructor_returns_pydantic_models_in_tools_and_json_schema_modes(server):
    import instructor
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        client = instructor.from_openai(openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0,
                                                      timeout=300), mode=mode)
        person = client.chat.completions.create(
            model=MODEL, response_model=Person, max_retries=0, temperature=0, max_tokens=60,
            messages=[{"role": "user", "content": "Alice is 31 years old. Extract her name and age."}])
        assert isinstance(person, Person), mode


def test_langchain_openai_structured_output_and_forced_tool(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        """A person."""

        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers and return the sum."""
        return a + b

    llm = ChatOpenAI(model=MODEL, base_url=server.base + "/v1", api_key=API_KEY, temperature=0, max_tokens=60,
                     max_retries=0, timeout=300)
    person = llm.with_structured_output(Person).invoke("Alice is 31 years old. Describe her.")
    assert isinstance(person, Person)
    message = llm.bind_tools([add], tool_choice="add").invoke("What is 2 plus 3?")
    (call,) = message.tool_calls
    assert call["name"] == "add" and set(call["args"]) == {"a", "b"}
    assert add.invoke(call["args"]) == call["args"]["a"] + call["args"]["b"]


# ---- last: a restart of `serve run` keeps the store ---------------------------------------------
def test_the_chain_goes_on_after_a_restart(client, server):
    before = client.responses.retrieve(server.chain[-1])
    server.restart()
    after = client.responses.retrieve(server.chain[-1])
    assert after.output_text == before.output_text
    more = client.responses.create(model=MODEL, previous_response_id=server.chain[-1], input="Thanks!",
                                   max_output_tokens=8, temperature=0)
    assert more.status in ("completed", "incomplete") and more.output_text
    items = client.responses.input_items.list(more.id, order="asc", limit=100)
    assert len(items.data) == 7 and items.data[-1].content[0].text == "Thanks!"
    client.responses.delete(more.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(more.id)
