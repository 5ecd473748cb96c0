"""The completions' legacy logprobs shape with `echo` (vLLM's, what lm-eval's local-completions
reads), whole and streamed, built from RequestOutputs (no Ray, no engine)."""
import pytest

from actors.http.openai_format import ChatFormat, CompletionFormat
from actors.http.prompt import PromptState
from cluster.outputs import CompletionOutput, Logprob, RequestOutput
from cluster.sampling_params import SamplingParams

pytestmark = pytest.mark.no_cluster  # starts no Ray (tests/actors/conftest.py)

TEXT = "The cat sat"


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from cluster.tokenizer import Tokenizer

    return Tokenizer.load(smollm2_path)


def _prompt(tokenizer, **params) -> tuple[PromptState, list]:
    ids = tokenizer.encode(TEXT)
    p = PromptState("cmpl-t-0", TEXT, ids, SamplingParams(**params))
    # Position p scores token p: its own logprob plus one alternative (id 5).
    lps = [None] + [{t: Logprob(-1.0 - i, 2), 5: Logprob(-0.5, 1)} for i, t in enumerate(ids[1:])]
    return p, lps


def _output(token: int, prompt_lps, finished: bool = True) -> RequestOutput:
    c = CompletionOutput(0, text=" on", token_ids=[token], logprobs=[{token: Logprob(-0.25, 1)}],
                         finish_reason="length" if finished else None, text_delta=" on", token_ids_delta=[token],
                         logprobs_delta=[{token: Logprob(-0.25, 1)}])
    return RequestOutput("cmpl-t-0", TEXT, [], [c], finished=finished, prompt_logprobs=prompt_lps)


def _offsets(tokens: list[str], start: int = 0) -> list[int]:
    out = []
    for tok in tokens:
        out.append(start)
        start += len(tok)
    return out


def test_echo_with_logprobs_leads_with_the_prompt(tokenizer):
    p, lps = _prompt(tokenizer, max_tokens=1, logprobs=1, prompt_logprobs=1)
    on = tokenizer.token_ids_for(" on")[0]
    p.final = _output(on, lps)
    body = CompletionFormat(tokenizer, "m", "cmpl-t", echo=True).response([p])
    choice = body["choices"][0]
    assert choice["text"] == TEXT + " on"
    got = choice["logprobs"]
    names = [tokenizer.decode([t], skip_special_tokens=False) for t in p.token_ids]
    assert got["tokens"] == names + [" on"]
    assert got["token_logprobs"] == [None] + [-1.0 - i for i in range(len(names) - 1)] + [-0.25]
    assert got["top_logprobs"][0] is None
    assert got["top_logprobs"][1] == {names[1]: -1.0, tokenizer.decode([5], skip_special_tokens=False): -0.5}
    assert got["top_logprobs"][-1] == {" on": -0.25}
    assert got["text_offset"] == _offsets(got["tokens"])
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == len(names)
    assert body["usage"]["completion_tokens"] == 1


def test_echo_with_max_tokens_0_is_the_prompt_alone(tokenizer):
    p, lps = _prompt(tokenizer, max_tokens=1, logprobs=0, prompt_logprobs=0)
    p.final = _output(tokenizer.token_ids_for(" on")[0], lps)
    body = CompletionFormat(tokenizer, "m", "cmpl-t", echo=True, echo_only=True).response([p])
    choice = body["choices"][0]
    assert choice["text"] == TEXT
    assert len(choice["logprobs"]["tokens"]) == len(p.token_ids)
    assert choice["logprobs"]["token_logprobs"][-1] == -1.0 - (len(p.token_ids) - 2)
    assert body["usage"] == {"prompt_tokens": len(p.token_ids), "completion_tokens": 0,
                             "total_tokens": len(p.token_ids), "prompt_tokens_details": {"cached_tokens": 0}}


def test_streamed_echo_puts_the_prompt_in_the_first_chunk(tokenizer):
    p, lps = _prompt(tokenizer, max_tokens=2, logprobs=0, prompt_logprobs=0)
    on = tokenizer.token_ids_for(" on")[0]
    fmt = CompletionFormat(tokenizer, "m", "cmpl-t", echo=True)
    first = fmt.chunks(0, p, _output(on, lps, finished=False))[0]["choices"][0]
    assert first["text"] == TEXT + " on"
    assert first["logprobs"]["token_logprobs"][0] is None and len(first["logprobs"]["tokens"]) == len(p.token_ids) + 1
    second_out = _output(on, lps)
    second_out.outputs[0].text = " on on"
    second = fmt.chunks(0, p, second_out)[0]["choices"][0]
    assert second["text"] == " on" and second["logprobs"]["tokens"] == [" on"]
    assert second["logprobs"]["text_offset"] == [len(TEXT) + len(" on")]


def test_plain_logprobs_keep_their_shape(tokenizer):
    p, _ = _prompt(tokenizer, max_tokens=1, logprobs=0)
    p.final = _output(tokenizer.token_ids_for(" on")[0], None)
    choice = CompletionFormat(tokenizer, "m", "cmpl-t", echo=False).response([p])["choices"][0]
    assert choice["text"] == " on" and choice["prompt_logprobs"] is None
    assert choice["logprobs"] == {"tokens": [" on"], "token_logprobs": [-0.25], "top_logprobs": [{" on": -0.25}],
                                  "text_offset": [0]}


def test_chat_puts_prompt_logprobs_beside_the_choices(tokenizer):
    p, lps = _prompt(tokenizer, max_tokens=1, prompt_logprobs=1)
    p.final = _output(tokenizer.token_ids_for(" on")[0], lps)
    body = ChatFormat(tokenizer, "m", "chatcmpl-t").response([p])
    assert body["prompt_logprobs"][0] is None
    assert body["prompt_logprobs"][1] == {str(p.token_ids[1]): {"logprob": -1.0, "rank": 2, "decoded_token": None},
                                          "5": {"logprob": -0.5, "rank": 1, "decoded_token": None}}
    p.params = SamplingParams(max_tokens=1)
    assert "prompt_logprobs" not in ChatFormat(tokenizer, "m", "chatcmpl-t").response([p])
