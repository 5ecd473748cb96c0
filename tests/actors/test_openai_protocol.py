"""OpenAI bodies -> SamplingParams, and the error mapping the ingress answers with (no Ray)."""
import pytest
from pydantic import ValidationError

from actors.channel.protocol import (EngineUnavailableError, FirstItem, MuxMessage, decode_first, decode_mux,
                                    encode_item, encode_request, request_of)
from actors.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, chat_params,
                                         completion_params, completion_prompts)
from actors.http.streams import engine_error
from cluster.errors import EngineInternalError, EngineOverloadedError
from cluster.messages import EngineOutput, EngineRequest, Logprobs, SamplingParams, decode

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

MSGS = [{"role": "user", "content": "hi"}]


def test_chat_fields_reach_sampling_params():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ChatCompletionRequest(messages=MSGS, temperature=0.0, max_completion_tokens=7, max_tokens=99,
                                seed=3, stop="END", logprobs=True, top_logprobs=2, top_k=5,
                                logit_bias={"17": -100}, vllm_xargs={"target_token": 9},
                                extra_args={"other": 1},
                                response_format={"type": "json_schema",
                                                 "json_schema": {"name": "x", "schema": schema}})
    p = chat_params(req)
    assert p.max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    assert p.seed == 3 and p.stop == ["END"] and p.logprobs == 2 and p.greedy
    assert p.logit_bias == {17: -100.0}
    assert p.extra_args == {"target_token": 9, "other": 1}
    assert p.structured_outputs.json == schema


def test_chat_defaults_leave_max_tokens_open_and_json_object():
    p = chat_params(ChatCompletionRequest(messages=MSGS, response_format={"type": "json_object"}))
    assert p.max_tokens is None and p.logprobs is None and p.temperature == 1.0
    assert p.structured_outputs.kind == "json_object"


def test_completion_defaults_and_vllm_structured_outputs():
    req = CompletionRequest(prompt="x", structured_outputs={"choice": ["yes", "no"]}, min_tokens=2,
                            repetition_penalty=1.2, ignore_eos=True, logprobs=3)
    p = completion_params(req)
    assert p.max_tokens == 16  # OpenAI's completions default
    assert p.structured_outputs.choice == ["yes", "no"]
    assert (p.min_tokens, p.repetition_penalty, p.ignore_eos, p.logprobs) == (2, 1.2, True, 3)


def test_echo_with_logprobs_scores_the_prompt():
    """vLLM's: echo + logprobs asks for the prompt's logprobs with as many alternatives (an
    explicit prompt_logprobs wins); echo + max_tokens 0 runs one token the answer leaves out."""
    p = completion_params(CompletionRequest(prompt="x", echo=True, logprobs=2, max_tokens=1))
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (2, 2, 1)
    p = completion_params(CompletionRequest(prompt="x", echo=True, logprobs=2, prompt_logprobs=0, max_tokens=0))
    assert (p.logprobs, p.prompt_logprobs, p.max_tokens) == (2, 0, 1)
    assert completion_params(CompletionRequest(prompt="x", echo=True)).prompt_logprobs is None
    assert completion_params(CompletionRequest(prompt="x", logprobs=1)).prompt_logprobs is None
    # A stream carries echoed logprobs in its first chunk; only an explicit prompt_logprobs > 0 is refused.
    assert completion_params(CompletionRequest(prompt="x", echo=True, logprobs=1, stream=True)).prompt_logprobs == 1
    assert completion_params(CompletionRequest(prompt="x", prompt_logprobs=0, stream=True)).prompt_logprobs == 0


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2, 3], [[1, 2, 3]]), ([[1], [2, 3]], [[1], [2, 3]])])
def test_completion_prompt_shapes(prompt, expected):
    assert completion_prompts(CompletionRequest(prompt=prompt)) == expected


@pytest.mark.parametrize("build, field", [
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, top_logprobs=2)), "top_logprobs"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, stream_options={"include_usage": True})),
     "stream_options"),
    (lambda: completion_params(CompletionRequest(prompt="x", stream=False, stream_options={})), "stream_options"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, logit_bias={"abc": 1})), "logit_bias"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, tools=[{"type": "function"}])), "tools"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, response_format={"type": "json_object"},
                                               structured_outputs={"regex": "a+"})), "structured_outputs"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, structured_outputs={"regex": "a", "choice": ["b"]})),
     "structured_outputs"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, response_format={"type": "json_schema"})),
     "response_format"),
    (lambda: completion_params(CompletionRequest(prompt="x", best_of=3)), "best_of"),
    (lambda: completion_params(CompletionRequest(prompt="x", suffix="y")), "suffix"),
    (lambda: completion_params(CompletionRequest(prompt="x", max_tokens=0)), "max_tokens"),
    (lambda: completion_params(CompletionRequest(prompt="x", prompt_logprobs=2, stream=True)), "prompt_logprobs"),
    (lambda: chat_params(ChatCompletionRequest(messages=MSGS, prompt_logprobs=1, stream=True)), "prompt_logprobs"),
])
def test_bad_fields_are_400_naming_the_field(build, field):
    with pytest.raises(OpenAIError) as info:
        build()
    assert info.value.status == 400
    assert field in (info.value.param or "") or field in info.value.message
    body = info.value.body()["error"]
    assert body["code"] == 400 and body["type"] == "BadRequestError" and body["message"]


def test_wrong_types_fail_parsing():
    with pytest.raises(ValidationError):
        ChatCompletionRequest(messages="hi")
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", n="many")


@pytest.mark.parametrize("build, field", [
    (lambda: ChatCompletionRequest(messages=MSGS, temperature=-1), "temperature"),
    (lambda: ChatCompletionRequest(messages=MSGS, n=0), "n"),
    (lambda: ChatCompletionRequest(messages=MSGS, logprobs=True, top_logprobs=-1), "top_logprobs"),
    (lambda: ChatCompletionRequest(messages=[]), "messages"),
    (lambda: ChatCompletionRequest(messages=MSGS, logit_bias={"5": 101}), "logit_bias"),
    (lambda: ChatCompletionRequest(messages=MSGS, seed=2**64), "seed"),
    (lambda: CompletionRequest(prompt="x", max_tokens=-1), "max_tokens"),
    (lambda: CompletionRequest(prompt="x", prompt_logprobs=-1), "prompt_logprobs"),
    (lambda: CompletionRequest(prompt=[]), "prompt"),
    (lambda: CompletionRequest(prompt=""), "prompt"),
    (lambda: CompletionRequest(prompt=[-1]), "prompt"),
])
def test_ranges_are_part_of_the_schema(build, field):
    """Enforced while parsing, so /openapi.json publishes them (HTTP 400 naming the field).
    Limits the operator configures (max_logprobs, max_n) are the engine's entry checks."""
    with pytest.raises(ValidationError) as info:
        build()
    assert all(e["loc"][0] == field for e in info.value.errors())


@pytest.mark.parametrize("exc, status", [
    (EngineOverloadedError("queue full"), 503), (EngineUnavailableError("dead"), 503),
    (ValueError("prompt too long"), 400), (RuntimeError("boom"), 500), (OpenAIError(404, "nope"), 404),
    (EngineInternalError("engine step failed: ValueError: bad row"), 500)])
def test_engine_errors_map_to_status(exc, status):
    err = engine_error(exc)
    assert err.status == status
    assert str(exc) in err.message


def test_output_batches_round_trip():
    outs = [EngineOutput("a", [5, 6], index=1, finish_reason="length", num_prompt_tokens=3),
            EngineOutput("a", [7], new_logprobs=Logprobs([[7, 1]], [[-0.1, -2.0]], [1]))]
    assert decode_first(encode_item(FirstItem(outs, "r", True))).outputs == outs
    assert decode_mux(encode_item(MuxMessage(0, outs))).outputs == outs


def test_a_request_is_decoded_only_in_another_process():
    import pickle

    import cloudpickle
    request = EngineRequest("r1", [4, 5, 6], SamplingParams(max_tokens=3))
    data = encode_request(request)
    assert request_of(data) is request  # the router, in the encoding process, reads it as is
    assert decode(data, EngineRequest) == request
    for dumps in (pickle.dumps, cloudpickle.dumps):  # how Ray ships a call's arguments
        sent = pickle.loads(dumps(data))
        assert type(sent) is bytes and sent == data
        assert request_of(sent) == request and request_of(sent) is not request
