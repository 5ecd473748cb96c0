"""The product end to end: `serve run` of a deploy file (through `actors.serve_cli`, what
`make serve` runs) as a subprocess on loopback, driven by the real `openai` SDK.

One Serve app for the whole module: SmolLM2 on CPU, TP=1, a deliberately small KV cache
(so 64 concurrent requests force preemptions), the docs' target-token processor, vLLM's
`qwen3` reasoning parser (<think> ... </think>) and the `hermes` tool-call parser.
"""
import asyncio
import json
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import yaml

from ray_helpers import ROOT, free_port, fuzz_openapi, http_status, loopback_env, stop_process, wait_for

MODEL = "smol-test"
API_KEY = "test-key"
NUM_KV_BLOCKS = 40  # x16 tokens: far fewer than 64 concurrent requests need, so some get preempted


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    http_port, metrics_port = free_port(), free_port()
    deploy = yaml.safe_load((ROOT / "deploy.yaml").read_text())
    deploy["http_options"]["port"] = http_port
    app = deploy["applications"][0]
    # The custom processor lives in tests/fixtures: put it on every replica's / worker's path.
    app["runtime_env"] = {"env_vars": {"PYTHONPATH": str(ROOT / "tests" / "fixtures")}}
    app["args"].update(preset="smollm2-cpu-small", served_model_name=MODEL, api_key=API_KEY,
                       num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=64, worker_torch_threads=1,
                       reasoning_parser="qwen3", tool_call_parser="hermes",
                       # Every test here runs with a step in flight while the engine applies
                       # the last one (test_app / test_fleet keep deploy.yaml's plain loop).
                       async_scheduling=True, response_store={"directory": str(tmp / "responses")},
                       # The last tests fail the engine copy: Serve replaces it after 3 failed
                       # health checks, 1 s apart here (default 5 s).
                       engine_health_check_period_s=1,
                       # ... by killing its worker actor (the default at one CPU rank is `uni`: no actor).
                       distributed_executor_backend="ray",
                       logits_processors=["dummy_logitsprocs:DummyLogitsProcessor",
                                          "dummy_logitsprocs:BuggyLogitsProcessor",
                                          "dummy_logitsprocs:SlowStepProcessor"])
    cfg = tmp / "deploy.yaml"
    cfg.write_text(yaml.safe_dump(deploy))
    log = tmp / "serve.log"
    env = loopback_env(LLM_CLUSTER_METRICS_PORT=str(metrics_port), RAY_metrics_report_interval_ms="2000")
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.serve_cli", str(cfg)], cwd=ROOT, env=env,
                                stdout=out, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_for(lambda: http_status(f"{base}/health") == 200, 600, "the Serve app to be healthy", proc, log)
        gcs = wait_for(lambda: re.search(r"address (\S+:\d+),", log.read_text()), 5, "the GCS address").group(1)
        yield {"base": base, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "gcs": gcs, "log": log,
               "pid": proc.pid}
    finally:
        stop_process(proc)




@pytest.fixture(scope="module")
def engine(server):
    """The engine replica's stats (operator endpoint). No Ray driver in this process: a
    driver attached to another cluster breaks starting a local one later in the session."""
    def stats() -> dict:
        r = requests.get(server["base"] + "/engine/stats", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        r.raise_for_status()
        return r.json()

    return stats


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from cluster.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_path)


def _word_tokens(tokenizer, n: int) -> list[int]:
    """n distinct token ids that are plain words (so their text round-trips)."""
    words = ["apple", "river", "stone", "cloud", "green", "table", "music", "light", "house", "paper",
             "water", "bread", "chair", "tiger", "ocean", "plant"]
    ids = []
    for w in words:
        for variant in (" " + w, w, " " + w.capitalize(), w.capitalize()):
            toks = tokenizer.token_ids_for(variant)
            if len(toks) == 1 and toks[0] not in ids:
                ids.append(toks[0])
    assert len(ids) >= n
    return ids[:n]


def _own_processes(server) -> list:
    """This server's processes (serve_cli's descendants): the host may run another server's."""
    import psutil

    return psutil.Process(server["pid"]).children(recursive=True)


# ---- the API surface ------------------------------------------------------------------------
def test_models_lists_the_configured_name(client, server):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http_status(server["base"] + "/health") == 200


def test_haproxy_serves_the_port_and_forwards_to_the_ingress_replicas_own_server(server, client):
    """serve_cli runs Serve's HAProxy ingress (actors/env.py): the HTTP port is HAProxy's, and it
    hands the connection to the ingress replica's own HTTP server (direct ingress), which
    answers the same API on its port; no Python proxy carries a request or its chunks."""
    import psutil

    port = int(server["base"].rsplit(":", 1)[1])
    # One snapshot of the listeners: Serve may reload HAProxy (a new process takes the sockets
    # over, the old one exits), so a second listing can miss the process the first one named.
    listeners = [c for c in psutil.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    listening = {c.laddr.port: c.pid for c in listeners}
    haproxy = psutil.Process(listening[port])
    assert "haproxy" in haproxy.name()
    # Started through actors/haproxy_buffering.sh: whole requests buffered, so retryable.
    config = haproxy.cmdline()[haproxy.cmdline().index("-f") + 1]
    assert config.endswith(".buffered.cfg") and "\n    option http-buffer-request\n" in open(config).read()
    # Its stats and Prometheus listeners on loopback too, as the HTTP frontend (a loopback test cluster)
    haproxy_listens = {c.laddr.ip for c in listeners if c.pid == haproxy.pid}
    assert haproxy_listens == {"127.0.0.1"}
    ours = {p.pid for p in _own_processes(server)}  # another server may hold a port in Serve's range too
    replica_ports = [p for p, pid in listening.items()
                     if pid in ours and 30000 <= p <= 31000 and "ingress" in " ".join(psutil.Process(pid).cmdline())]
    assert len(replica_ports) == 1  # the one ingress replica
    direct = openai.OpenAI(base_url=f"http://127.0.0.1:{replica_ports[0]}/v1", api_key=API_KEY, max_retries=0)
    prompt = dict(model=MODEL, prompt="One, two,", max_tokens=6, temperature=0)
    assert direct.completions.create(**prompt).choices[0].text == client.completions.create(**prompt).choices[0].text


def test_completion_matches_the_offline_engine(client, tokenizer):
    from cluster import LLM, SamplingParams

    prompt = "The capital of France is"
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    llm = LLM("smollm2-135m-instruct", dtype="auto", max_model_len=1024, num_kv_blocks=64)
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert got.choices[0].text == ref.outputs[0].text
    assert got.usage.prompt_tokens == len(tokenizer.encode(prompt)) and got.usage.completion_tokens == 12
    assert got.choices[0].finish_reason == "length"


def test_streamed_chat_concatenates_to_the_non_streamed_text(client):
    messages = [{"role": "user", "content": "Name three colors of the rainbow."}]
    # Both requests below then hit the prefix cache alike: a first computation of the prompt
    # (SDPA over all of it) and a cache hit (the kernel over its tail) round bf16 differently, and
    # greedy text may follow either; what is compared here is the streaming, not the cache.
    client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0)
    text = full.choices[0].message.content
    assert text and full.usage.completion_tokens > 0
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_json_schema_response_validates(client):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.chat.completions.create(
        model=MODEL, max_tokens=60, temperature=0,
        messages=[{"role": "user", "content": "Describe a person as JSON with name and age."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}})
    jsonschema.validate(json.loads(out.choices[0].message.content), schema)


def test_vllm_xargs_reach_the_custom_processor(client, tokenizer):
    target = _word_tokens(tokenizer, 1)[0]
    out = client.completions.create(model=MODEL, prompt="Say something:", max_tokens=6, temperature=0.8,
                                    seed=1, extra_body={"vllm_xargs": {"target_token": target}})
    assert out.choices[0].text == tokenizer.decode([target] * 6)
    with pytest.raises(openai.BadRequestError, match="target_token"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2,
                                  extra_body={"vllm_xargs": {"target_token": "not-a-token"}})


def test_n_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                         max_tokens=8, temperature=1.0, seed=7, logprobs=True, top_logprobs=2)
    assert sorted(c.index for c in out.choices) == [0, 1]
    for choice in out.choices:
        content = choice.logprobs.content
        assert "".join(t.token for t in content) == choice.message.content
        assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert out.usage.completion_tokens == sum(len(c.logprobs.content) for c in out.choices)


def test_tokens_a_grammar_rules_out_have_vllms_finite_logprob(client):
    """Under a choice constraint most candidates have logprob -inf, which JSON cannot carry:
    they come back as -9999.0 (vLLM's value), never null, in both API shapes."""
    body = dict(model=MODEL, max_tokens=4, temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Is the sky blue?"}], logprobs=True,
                                          top_logprobs=5, **body).choices[0]
    tops = [t.logprob for tok in chat.logprobs.content for t in tok.top_logprobs]
    assert None not in tops and -9999.0 in tops and chat.message.content in ("yes", "no")
    text = client.completions.create(prompt="Is the sky blue? Answer:", logprobs=5, **body).choices[0]
    tops = [lp for top in text.logprobs.top_logprobs for lp in top.values()]
    assert None not in tops and -9999.0 in tops


def test_stop_string_ends_the_text_and_the_request(client, engine):
    params = dict(model=MODEL, prompt="1, 2, 3, 4, 5,", temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(max_tokens=16, **params).choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    before = engine()
    out = client.completions.create(max_tokens=400, stop=[stop], **params).choices[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:text.index(stop)], "stop", stop)
    streamed = client.completions.create(max_tokens=400, stop=[stop], stream=True, **params)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == out.text
    # The ingress cancels the engine stream on the stop string: the engine aborts the request.
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 60, "the stop-string abort")
    assert after["generation_tokens"] - before["generation_tokens"] < 100
    assert after["num_free_blocks"] == after["num_blocks"]


def test_several_prompts_stream_interleaved(client):
    prompts = ["The sky is", "Water is made of"]
    full = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    texts = {c.index: c.text for c in full.choices}
    assert sorted(texts) == [0, 1] and all(texts.values())
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == texts


def test_tokenize_endpoint(server, tokenizer):
    r = requests.post(server["base"] + "/tokenize", json={"model": MODEL, "prompt": "Hello world"},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 200
    assert r.json()["tokens"] == tokenizer.encode("Hello world")


def test_errors_are_openai_shaped_with_the_right_status(client, server):
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt=[1] * 2000, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server["base"] + "/v1", api_key="wrong", max_retries=0).models.list()
    r = requests.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": "x", "n": "many"},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400 and "n" in r.json()["error"]["message"]


# ---- reasoning, tools, legacy fields ----------------------------------------------------------
THINKING = [{"role": "user", "content": "Describe a person in one sentence."},
            {"role": "assistant", "content": "<think>\n"}]  # continued: the answer starts inside a block


def test_reasoning_content_is_split_from_content(client, tokenizer):
    kwargs = dict(model=MODEL, messages=THINKING, max_tokens=30, temperature=0,
                  extra_body={"continue_final_message": True, "add_generation_prompt": False,
                              "thinking_token_budget": 6})
    # bf16 GEMMs round differently at different batch sizes, so a greedy answer can depend on
    # how much of the prompt the prefix cache already holds (an earlier test may have cached
    # part of it). One call first puts the prompt's full blocks in the cache; the three calls
    # compared below then all compute the same rows the same way.
    client.chat.completions.create(**kwargs)
    full = client.chat.completions.create(**kwargs)
    msg = full.choices[0].message
    assert msg.reasoning_content and msg.reasoning == msg.reasoning_content
    assert "</think>" not in msg.reasoning_content + msg.content and msg.content.strip()
    assert 0 < full.usage.completion_tokens_details.reasoning_tokens < full.usage.completion_tokens
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content
    # The completions API returns the raw text, markers and all.
    prompt = tokenizer.apply_chat_template(THINKING, add_generation_prompt=False, continue_final_message=True,
                                           tokenize=True)
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0,
                                    extra_body={"thinking_token_budget": 6}).choices[0].text
    assert raw == msg.reasoning_content + "</think>" + msg.content


def test_reasoning_then_json_schema_over_http(client):
    import jsonschema

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}
    out = client.chat.completions.create(
        model=MODEL, messages=THINKING, max_tokens=60, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
        extra_body={"continue_final_message": True, "add_generation_prompt": False, "thinking_token_budget": 8})
    msg = out.choices[0].message
    assert msg.reasoning_content and out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(msg.content), schema)


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "Current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 24}},
                   "required": ["timezone"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]


def _streamed_calls(stream) -> dict[int, dict]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] = (d.function.name if d.function else None) or call["name"]
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    return {"calls": [calls[i] for i in sorted(calls)], "finish": finish}


@pytest.mark.parametrize("choice, finish", [
    ({"type": "function", "function": {"name": "get_weather"}}, "stop"), ("required", "tool_calls")])
def test_forced_tool_calls_validate_and_stream(client, choice, finish):
    import jsonschema

    from actors.http.tool_parser import MAX_PARALLEL_TOOL_CALLS

    params = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    # Room for the most calls `required` allows: a model may repeat a call (SmolLM2 does, in
    # bf16, where two candidate tokens tie), and the grammar ends the list at that many.
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=choice,
                  max_tokens=40 * MAX_PARALLEL_TOOL_CALLS, temperature=0)
    # Greedy decoding over a cached prefix may break a bf16 tie otherwise than a full prefill:
    # a first request caches the prompt, so the two compared below decode the same way.
    client.chat.completions.create(**{**kwargs, "max_tokens": 1})
    out = client.chat.completions.create(**kwargs).choices[0]
    assert out.finish_reason == finish and out.message.content is None and out.message.tool_calls
    assert len(out.message.tool_calls) <= MAX_PARALLEL_TOOL_CALLS
    for call in out.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    if isinstance(choice, dict):
        assert [c.function.name for c in out.message.tool_calls] == ["get_weather"]
    streamed = _streamed_calls(client.chat.completions.create(stream=True, **kwargs))
    assert streamed["finish"] == finish
    assert [(c["name"], c["arguments"]) for c in streamed["calls"]] == [
        (c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert all(c["id"].startswith("call_") for c in streamed["calls"])


def test_tool_result_round_trip_and_auto(client):
    call = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=60, temperature=0,
                                          tool_choice={"type": "function", "function": {"name": "get_weather"}}
                                          ).choices[0].message.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                           "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "sunny"}'}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=40,
                                            temperature=0).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    if answer.message.tool_calls:  # auto: whatever the model calls must parse
        assert all(c.function.name == "get_weather" and json.loads(c.function.arguments)
                   for c in answer.message.tool_calls)
    else:
        assert answer.message.content.strip()


def test_legacy_guided_fields_constrain(client):
    import jsonschema

    schema = {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}
    cases = [({"guided_choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
             ({"guided_regex": r"[0-9]{3}-[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
             ({"guided_json": schema, "guided_whitespace_pattern": " ?", "guided_decoding_backend": "xgrammar"},
              lambda t: jsonschema.validate(json.loads(t), schema) is None),
             ({"guided_grammar": 'root ::= "A" [0-9] [0-9]'}, lambda t: re.fullmatch(r"A[0-9]{2}", t))]
    for extra, ok in cases:
        text = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=20, temperature=0,
                                         extra_body=extra).choices[0].text
        assert ok(text), (extra, text)


@pytest.mark.parametrize("kwargs, field", [
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
     "tools[0].function.parameters"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_time"}}), "tool_choice"),
    (dict(tool_choice="required"), "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    (dict(extra_body={"use_beam_search": True}), "use_beam_search"),
    (dict(extra_body={"guided_regex": "a+", "structured_outputs": {"regex": "b+"}}), "guided_"),
    (dict(extra_body={"guided_choice": ["a"], "guided_decoding_backend": "outlines"}), "guided_decoding_backend"),
])
def test_bad_tool_and_legacy_specs_are_400(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, **kwargs)
    error = info.value.body
    assert error["code"] == 400 and field in (error["param"] or "") and error["message"]


def test_openapi_fuzz_finds_no_server_error(server, engine, tmp_path):
    """schemathesis over /openapi.json: no 5xx, no status the schema does not document.
    Generation is capped at a few tokens per request (tests/fixtures/schemathesis_hooks.py)."""
    spec = requests.get(server["base"] + "/openapi.json", timeout=30).json()
    chat = spec["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["messages"]["minItems"] == 1 and chat["temperature"]["anyOf"][0]["minimum"] == 0
    assert all("422" not in op["responses"] and {"400", "503"} <= set(op["responses"])
               for path, ops in spec["paths"].items() if path != "/health" for op in ops.values())
    assert fuzz_openapi(server["base"], tmp_path, f"Authorization: Bearer {API_KEY}", 25, 11) >= 80
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 120, "the fuzz requests to finish")
    assert after["num_free_blocks"] == after["num_blocks"]


# ---- engine behaviour under the API ----------------------------------------------------------
def test_client_disconnect_aborts_and_frees_blocks(server, engine):
    idle = engine()
    assert idle["num_unfinished"] == 0
    assert idle["spec_decode_num_drafts"] == 0  # the spec counters are served (no speculation here)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 500, "ignore_eos": True,
            "stream": True}
    with requests.post(server["base"] + "/v1/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens: the request is running
        assert any(line.startswith(b"data: {") for line in got)
        busy = engine()
        assert busy["running"] == 1 and busy["num_free_blocks"] < idle["num_free_blocks"]
    # The connection is closed mid-stream: the engine must abort the request and free its blocks.
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 60, "the abort")
    assert after["num_free_blocks"] == idle["num_free_blocks"] == after["num_blocks"]
    assert after["generation_tokens"] - idle["generation_tokens"] < 500


def test_a_disconnect_loses_no_other_requests_outputs(server, client, engine):
    """The first request's call carries the outputs of every request of the ingress (actors/engine_replica/
    mux.py). Its client going away must not cut that call: Serve cancels the calls a cancelled
    request made, and a message in flight on the carrier would be lost, stalling every later
    stream of the ingress (they then end in a 500 after the grace period)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    carrier = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True,
               "stream": True}
    other = dict(model=MODEL, prompt="Count to a hundred.", max_tokens=48, extra_body={"ignore_eos": True})
    with ThreadPoolExecutor(1) as pool:
        for _ in range(6):  # the loss needed a message in flight at the disconnect: try a few times
            with requests.post(server["base"] + "/v1/completions", json=carrier, stream=True, timeout=120,
                               headers=headers) as r:
                lines = r.iter_lines()
                next(lines)
                later = pool.submit(lambda: list(client.completions.create(
                    stream=True, stream_options={"include_usage": True}, **other)))
                for _ in range(8):  # the other request streams on the carrier's call by now
                    next(lines)
            chunks = later.result(timeout=120)
            assert chunks[-1].usage.completion_tokens == 48
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 60, "the aborts")
    assert after["num_free_blocks"] == after["num_blocks"]
    # Each disconnect ended its call through the ingress's abort, never from outside.
    assert [m["cut_calls"] for m in after["muxes"].values()] == [0]
    assert client.completions.create(**other).usage.completion_tokens == 48


def test_streams_are_per_token_over_one_message_per_step(server, tokenizer, engine):
    """deploy.yaml streams every token (stream_interval 1), yet the engine sends the ingress
    one message per step for all of its concurrent requests (actors/channel/mux.py)."""
    targets = _word_tokens(tokenizer, 8)
    aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=300)
    before = engine()

    async def one(i: int) -> list[tuple[int, str]]:
        # Slow steps: the ingress is never a step behind, so nothing is coalesced.
        extra = {"vllm_xargs": {"target_token": targets[i], "step_delay_s": 0.05}, "ignore_eos": True}
        stream = await aclient.completions.create(model=MODEL, prompt=f"Stream {i}: say one word.", max_tokens=16,
                                                  logprobs=1, stream=True, extra_body=extra)
        return [(len(c.choices[0].logprobs.tokens) if c.choices[0].logprobs else 0, c.choices[0].text)
                async for c in stream if c.choices]

    async def run():
        try:
            return await asyncio.gather(*[one(i) for i in range(8)])
        finally:
            await aclient.close()

    streams = asyncio.run(run())
    after = engine()
    for i, chunks in enumerate(streams):
        assert [n for n, _ in chunks if n] == [1] * 16, chunks  # one token per chunk, the first too
        assert "".join(text for _, text in chunks) == tokenizer.decode([targets[i]] * 16)
    assert len(after["muxes"]) == 1  # one ingress replica: one multiplexed stream
    (ingress, mux), = after["muxes"].items()
    messages = mux["messages"] - before["muxes"].get(ingress, {}).get("messages", 0)
    outputs = mux["outputs"] - before["muxes"].get(ingress, {}).get("outputs", 0)
    assert 8 * 15 <= outputs <= 8 * 16  # every token after each request's first went multiplexed
    # At most one message per step, each carrying the step's outputs of all 8 requests.
    assert 0 < messages <= after["steps"] - before["steps"] and messages * 4 <= outputs, (messages, outputs)
    assert mux["open_calls"] == 0 and after["num_streams"] == 0


@pytest.fixture(scope="module")
def burst(server, client, tokenizer, engine):
    """64 concurrent requests: each forces its own token (via the processor), so any mix-up
    between requests in the batch shows; some are streamed, some not."""
    targets = _word_tokens(tokenizer, 16)
    aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=600)
    before = engine()

    async def one(i: int):
        extra = {"vllm_xargs": {"target_token": targets[i % 16]}, "ignore_eos": True}
        kwargs = dict(model=MODEL, prompt=f"Request number {i}: write about topic {i * 7}.", max_tokens=24,
                      temperature=0.7, seed=i, extra_body=extra)
        if i % 2:
            stream = await aclient.completions.create(stream=True, **kwargs)
            return "".join([c.choices[0].text async for c in stream if c.choices])
        return (await aclient.completions.create(**kwargs)).choices[0].text

    async def run():
        try:
            return await asyncio.gather(*[one(i) for i in range(64)])
        finally:
            await aclient.close()

    texts = asyncio.run(run())
    return {"texts": texts, "targets": targets, "before": before, "after": engine()}


def test_64_concurrent_requests_complete_correctly(burst, tokenizer):
    for i, text in enumerate(burst["texts"]):
        assert text == tokenizer.decode([burst["targets"][i % 16]] * 24), i
    after = burst["after"]
    assert after["running"] == after["waiting"] == after["num_unfinished"] == after["num_streams"] == 0
    assert after["num_free_blocks"] == after["num_blocks"] == NUM_KV_BLOCKS
    assert after["preemptions"] > burst["before"]["preemptions"]  # the small cache was exercised
    assert after["generation_tokens"] - burst["before"]["generation_tokens"] >= 64 * 24


METRICS = ["ray_llm_requests_running", "ray_llm_requests_waiting", "ray_llm_kv_cache_usage",
           "ray_llm_prefix_cache_hit_rate", "ray_llm_preemptions", "ray_llm_prompt_tokens",
           "ray_llm_generation_tokens", "ray_llm_time_to_first_token_seconds_bucket",
           "ray_llm_inter_token_latency_seconds_bucket", "ray_llm_e2e_request_latency_seconds_bucket"]


def _metric_sum(text: str, name: str) -> float:
    pattern = rf'^{name}(?:_total)?{{[^}}]*model_name="{MODEL}"[^}}]*}} (\S+)'
    return sum(float(v) for v in re.findall(pattern, text, re.M))


def test_metrics_on_the_node_endpoint(server, burst):
    def scrape():
        try:
            text = requests.get(server["metrics"], timeout=10).text
        except requests.RequestException:
            return None
        present = all(re.search(rf"^{m}(_total)?{{", text, re.M) for m in METRICS)
        # Counters reach the endpoint a report interval after the engine records them.
        flushed = (_metric_sum(text, "ray_llm_generation_tokens") >= 64 * 24
                   and _metric_sum(text, "ray_llm_e2e_request_latency_seconds_count") >= 64)
        return text if present and flushed else None

    text = wait_for(scrape, 90, "all llm metrics on " + server["metrics"])
    assert _metric_sum(text, "ray_llm_time_to_first_token_seconds_count") >= 64
    assert _metric_sum(text, "ray_llm_inter_token_latency_seconds_count") >= 64 * 23
    assert _metric_sum(text, "ray_llm_preemptions") >= 1
    assert _metric_sum(text, "ray_llm_prompt_tokens") > 64 * 8
    # Requests by endpoint: the burst's 64 completions at least (other tests add their own).
    series = re.findall(r"^ray_llm_api_requests_total{([^}]*)} (\S+)", text, re.M)
    assert sum(float(v) for labels, v in series
               if 'endpoint="completions"' in labels and f'model_name="{MODEL}"' in labels) >= 64
    # After the traffic the gauges settle at idle: nothing running, no KV block in use.
    def idle_gauges():
        t = requests.get(server["metrics"], timeout=10).text
        quiet = _metric_sum(t, "ray_llm_kv_cache_usage") == 0 and _metric_sum(t, "ray_llm_requests_running") == 0
        return t if quiet else None

    idle = wait_for(idle_gauges, 60, "idle gauges")
    assert re.search(rf'^ray_llm_kv_cache_usage{{[^}}]*model_name="{MODEL}"', idle, re.M)


def test_the_dashboard_off_leaves_the_metrics_endpoint(server, burst):
    """$LLM_CLUSTER_RAY_DASHBOARD=0 (the tests' servers, ray_helpers.loopback_env): Ray's dashboard
    head of this server loads only its usage-stats module (no module processes, no web UI, no
    state API), and the node's metrics endpoint (Ray's agent) answers with the engine's metrics all the
    same (test_metrics_on_the_node_endpoint reads them)."""
    assert "dashboard off ($LLM_CLUSTER_RAY_DASHBOARD=0)" in server["log"].read_text()
    heads = [p for p in _own_processes(server) if "dashboard/dashboard.py" in " ".join(p.cmdline())]
    assert len(heads) == 1
    cmdline = heads[0].cmdline()
    assert "--modules-to-load=UsageStatsHead" in cmdline and "--disable-frontend" in cmdline
    assert heads[0].children(recursive=True) == []
    assert requests.get(server["metrics"], timeout=10).status_code == 200


# ---- admission control ------------------------------------------------------------------------
def _post(server, path: str, body: dict, **kwargs) -> requests.Response:
    return requests.post(server["base"] + path, json=body, timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}"}, **kwargs)


HI = [{"role": "user", "content": "Hi"}]
OVERSIZED = [  # (path, body, what the 400's message must say); the small preset: max_model_len 1024
    ("/v1/chat/completions", {"messages": HI, "n": 129}, "n=129 is more than this server allows (max_n=128)"),
    ("/v1/completions", {"prompt": "x", "n": 129, "best_of": 129}, "max_n=128"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 10_000_000},
     "maximum context length is 1024 tokens, and this request asks for 10000001 (1 in the prompt, 10000000 in"),
    ("/v1/chat/completions", {"messages": HI, "max_completion_tokens": 5000}, "5000 in the completion"),
    ("/v1/chat/completions", {"messages": HI, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs=21 is more than this server returns"),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 21}, "max_logprobs=20"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs=21"),
    ("/v1/completions", {"prompt": "x", "priority": 1}, "needs scheduling_policy='priority'"),
    # Megabytes of text: refused from its length, never tokenized (1024 tokens x 81 characters at most).
    ("/v1/completions", {"prompt": "x " * 1_000_000}, "prompt is too long: 2000000 characters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "y" * 3_000_000}]}, "messages is too long"),
    ("/tokenize", {"prompt": "z" * 3_000_000}, "prompt is too long"),
    ("/v1/completions", {"prompt": "x" * 5_000_000}, "larger than this server accepts (max_request_body_bytes=4194304)"),
]


def test_oversized_values_are_refused_and_change_nothing(server, client, engine):
    before = engine()
    for path, body, message in OVERSIZED:
        r = _post(server, path, {"model": MODEL, **body})
        assert r.status_code == 400, (path, r.text[:300])
        error = r.json()["error"]
        assert error["code"] == 400 and message in error["message"], (path, error)
    # Without a Content-Length (chunked upload) the body is refused as its bytes arrive.
    chunks = iter([b'{"model": "' + MODEL.encode() + b'", "prompt": "', b"x" * 5_000_000, b'"}'])
    r = requests.post(server["base"] + "/v1/completions", data=chunks, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "max_request_body_bytes" in r.json()["error"]["message"]
    assert engine() == before  # nothing reached the engine: no request, token, block or counter moved
    out = client.completions.create(model=MODEL, prompt="x", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_small_request_finishes_while_an_n128_request_streams(server, engine):
    """Another client's 8-token request is not queued behind the 128 completions."""
    aclient = openai.AsyncOpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0, timeout=600)

    async def run():
        started, finished = asyncio.Event(), {}

        async def big():
            stream = await aclient.completions.create(model=MODEL, prompt="Write a poem about the sea.", n=128,
                                                      max_tokens=16, temperature=1.0, seed=5, stream=True,
                                                      extra_body={"ignore_eos": True})
            async for chunk in stream:
                started.set()
                finished.update({c.index: c.finish_reason for c in chunk.choices if c.finish_reason})

        try:
            task = asyncio.create_task(big())
            await started.wait()
            small = await aclient.completions.create(model=MODEL, prompt="Hi", max_tokens=8,
                                                     extra_body={"ignore_eos": True})
            big_finished_by_then = len(finished)
            await task
            return small, big_finished_by_then, finished
        finally:
            await aclient.close()

    small, big_finished_by_then, finished = asyncio.run(run())
    # Queued behind the big request (first come, first served) it would start only once all 128
    # completions had, i.e. after most of them finished; it starts at once instead.
    assert small.usage.completion_tokens == 8 and big_finished_by_then < 64
    assert finished == {i: "length" for i in range(128)}
    after = wait_for(lambda: (s := engine())["num_unfinished"] == 0 and s, 60, "the engine to go idle")
    assert after["num_free_blocks"] == after["num_blocks"]


def test_aborted_n128_request_leaves_queue_and_blocks_at_once(server, engine):
    idle = engine()
    body = {"model": MODEL, "prompt": "Tell me a long story.", "n": 128, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    with requests.post(server["base"] + "/v1/completions", json=body, stream=True, timeout=120,
                       headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        next(line for line in r.iter_lines() if line.startswith(b"data: {"))
        busy = engine()
        assert busy["num_unfinished"] == 1 and busy["waiting"] > 0 and busy["running"] > 0
    # Every snapshot after the disconnect holds either all of the request or none of it.
    seen = []

    def gone():
        seen.append(s := engine())
        return s["num_unfinished"] == 0 and s

    after = wait_for(gone, 60, "the abort")
    assert all(s["num_unfinished"] == 1 or (s["waiting"], s["running"]) == (0, 0) for s in seen)
    assert (after["waiting"], after["running"]) == (0, 0) and after["num_free_blocks"] == after["num_blocks"]
    assert after["finished"].get("abort", 0) - idle["finished"].get("abort", 0) == 128


# ---- last: these replace the engine replica ---------------------------------------------------
def _wait_for_replacement(engine, old: str) -> None:
    def replaced():
        try:
            return engine()["actor_namespace"] != old
        except requests.HTTPError:
            return False

    wait_for(replaced, 240, "a replacement engine replica")


def test_internal_error_in_a_step_is_a_500_never_a_400(server, client, engine):
    old = engine()["actor_namespace"]
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "vllm_xargs": {"raise_in_step": True}}
    r = requests.post(server["base"] + "/v1/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "internal error" in error["message"] and "BuggyLogitsProcessor" in error["message"]
    # The broken replica refuses work (503) until Serve has replaced it; then all is well.
    _wait_for_replacement(engine, old)
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4


def test_dead_worker_makes_serve_replace_the_engine(server, client, engine):
    old = engine()["actor_namespace"]
    # Kill worker-0 of this engine copy from a separate driver process on the cluster.
    kill = ("import ray, sys\n"
            "ray.init(address=sys.argv[1], log_to_driver=False)\n"
            "w = ray.get_actor('worker-0', namespace=sys.argv[2])\n"
            "ray.kill(w)\n"
            "try:\n"
            "    ray.get(w.ping.remote(), timeout=30)\n"
            "except ray.exceptions.RayActorError:\n"
            "    print('dead')\n")
    done = subprocess.run([sys.executable, "-c", kill, server["gcs"], old], env=loopback_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "dead", done.stderr[-2000:]
    # The broken copy answers 503; if Serve's health check caught it first, the request waits
    # for the replacement copy and succeeds there.
    try:
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert engine()["actor_namespace"] != old, "the dead worker's engine served a request"
    except openai.APIStatusError as exc:
        assert exc.status_code == 503, exc
    # The engine reports unhealthy; Serve starts a new replica with its own workers.
    _wait_for_replacement(engine, old)
    out = client.completions.create(model=MODEL, prompt="hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert engine()["num_free_blocks"] == NUM_KV_BLOCKS
