"""OpenAI request bodies (plus vLLM's extra fields) and their translation to SamplingParams.

Pure functions and pydantic models: no Ray, no engine. The ingress parses a body with
these models, builds `SamplingParams` with `sampling_params()` and then runs the engine's
own entry checks (`InputProcessor`), so every bad request is an HTTP 400 here.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from actors.http.tool_parser import ToolRequest, ToolSpecError, tool_request
from cluster.errors import QUEUE_TIMEOUT, REQUEST_TIMEOUT
from cluster.sampling_params import SamplingParams, StructuredOutputsParams

# Fields OpenAI or vLLM define that this server does not implement, with the value that means
# "not used": a request setting one to anything else gets a 400 naming it instead of being
# served without it (docs/structured_output.md lists them).
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "early_stopping": False, "truncate_prompt_tokens": None,
    "prompt_embeds": None, "audio": None, "modalities": ["text"], "prediction": None, "functions": None,
    "function_call": None, "return_tokens_as_token_ids": False, "mm_processor_kwargs": None,
    "documents": None, "web_search_options": None, "reasoning_effort": None, "logits_processors": None,
    "guided_decoding": None, "echo": False,
}
# The legacy guided_* fields (vLLM before structured_outputs) and the key each maps to.
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
NonNegInt = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**64 - 1)]
Bias = Annotated[float, Field(ge=-100, le=100)]


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 408: "RequestTimeoutError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code  # OpenAI's error code where it has one (e.g. "model_not_found"); else the status
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.code or self.status}}


RETRY_AFTER_S = 1  # what a 503 for a full queue or a queue deadline asks clients to wait


def retry_later(message: str, code: str | None = None) -> OpenAIError:
    """503 with Retry-After: the server is busy now (a full queue, a queue deadline)."""
    return OpenAIError(503, message, code=code, headers={"Retry-After": str(RETRY_AFTER_S)})


def output_error(message: str, code: str | None) -> OpenAIError:
    """The HTTP answer for a request the engine ended with an error (cluster.errors' codes)."""
    if code == QUEUE_TIMEOUT:
        return retry_later(message, code)
    if code == REQUEST_TIMEOUT:
        return OpenAIError(408, message, code=code)
    return OpenAIError(500, message)


class _Body(BaseModel):
    # Unknown fields are ignored, as vLLM and OpenAI do (SDKs send fields we do not use).
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(_Body):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    # structural_tag: vLLM passes the whole object through (format / structures / triggers).
    model_config = ConfigDict(extra="allow", populate_by_name=True)


class _SamplingBody(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions. The ranges here are the ones
    enforced (the OpenAPI schema publishes them); anything else unknown is ignored, except the
    `UNSUPPORTED_FIELDS`, which are refused."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logit_bias: dict[str, Bias] | None = None
    seed: Seed | None = None
    user: str | None = None
    priority: int = 0  # vLLM's: lower first, with scheduling_policy "priority"
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[NonNegInt] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(default=None, ge=0)
    structured_outputs: dict[str, Any] | None = None
    thinking_token_budget: int | None = Field(default=None, ge=-1)
    # vLLM's legacy structured-output fields (mapped onto structured_outputs).
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    # Per-request arguments for custom logits processors (vLLM's name, and ours).
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None


class CompletionRequest(_SamplingBody):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[NonNegInt], Field(min_length=1)]
             | Annotated[list[Annotated[list[NonNegInt], Field(min_length=1)]], Field(min_length=1)])
    # 0 only with echo (vLLM's): the prompt comes back, scored with `logprobs`, and nothing more.
    max_tokens: int | None = Field(default=None, ge=0)
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingBody):
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool = True  # vLLM: False leaves reasoning_content out
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    """vLLM's `/tokenize`: a `prompt` (its completion form) or `messages` (its chat form:
    `add_generation_prompt`, `continue_final_message`, `chat_template_kwargs`, `tools`);
    `return_token_strs` adds each token's string. `add_special_tokens` applies to a prompt (a
    chat template writes its own special tokens)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False

    def chat_kwargs(self) -> tuple[bool, dict[str, Any]]:
        """(add_generation_prompt, the chat template's kwargs) of the chat form."""
        if self.continue_final_message and self.add_generation_prompt and \
                "add_generation_prompt" in self.model_fields_set:
            raise OpenAIError(400, "continue_final_message and add_generation_prompt cannot both be true",
                              "continue_final_message")
        kwargs = dict(self.chat_template_kwargs or {})
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        if self.tools:
            kwargs["tools"] = self.tools
        return self.add_generation_prompt and not self.continue_final_message, kwargs


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body; `model` (ours) picks the base when several serve LoRA."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    model: str | None = None


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; not used
    model: str | None = None


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The request's prompts: each a string or a list of token ids."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise OpenAIError(400, "prompt must not be empty", "prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    return list(p)


def structured_outputs(body: _SamplingBody) -> StructuredOutputsParams | None:
    """`structured_outputs` (vLLM), `response_format` (OpenAI) or the legacy `guided_*`
    fields; giving more than one of these is ambiguous."""
    given: list[tuple[str, dict[str, Any]]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        given.append(("response_format", {"json": rf.json_schema.json_schema}))
    elif rf is not None and rf.type == "structural_tag":
        given.append(("response_format", {"structural_tag": rf.model_dump(exclude={"type"}, exclude_none=True)}))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", body.structured_outputs))
    guided = {key: getattr(body, name) for name, key in GUIDED_FIELDS.items() if getattr(body, name) is not None}
    if guided:
        given.append(("guided_*", guided))
    if len(given) > 1:
        names = " and ".join(n for n, _ in given)
        raise OpenAIError(400, f"give one of response_format, structured_outputs or guided_*, got {names}",
                          given[-1][0])
    _check_guided_backend(body.guided_decoding_backend)
    if not given:
        return None
    spec = dict(given[0][1])
    if body.guided_whitespace_pattern is not None:
        spec.setdefault("disable_any_whitespace", _compact_whitespace(body.guided_whitespace_pattern))
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(400, f"structured_outputs: {exc}", given[0][0]) from exc


def _check_guided_backend(backend: str | None) -> None:
    # vLLM's spelling: a backend name, optionally followed by ":options".
    if backend is not None and backend.split(":")[0] not in ("auto", "xgrammar"):
        raise OpenAIError(400, f"guided_decoding_backend {backend!r} is not supported: structured output "
                               "runs on xgrammar ('xgrammar' or 'auto')", "guided_decoding_backend")


def _compact_whitespace(pattern: str) -> bool:
    """xgrammar has two JSON whitespace modes: free, or fixed single spaces. A pattern that
    cannot match a newline asks for the compact one."""
    try:
        return re.fullmatch(pattern, "\n") is None
    except re.error as exc:
        raise OpenAIError(400, f"guided_whitespace_pattern is not a valid regex: {exc}",
                          "guided_whitespace_pattern") from exc


def reject_unsupported(body: _SamplingBody) -> None:
    """A known field we do not implement, set to something other than 'unused': 400."""
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED_FIELDS and value != UNSUPPORTED_FIELDS[name] and value is not None:
            raise OpenAIError(400, f"{name} is not supported by this server", name)


def chat_tools(req: "ChatCompletionRequest") -> ToolRequest | None:
    """The request's checked tools and tool_choice (None without tools)."""
    try:
        return tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    except ToolSpecError as exc:
        raise OpenAIError(400, str(exc), exc.param) from exc


def sampling_params(body: _SamplingBody, *, max_tokens: int | None, logprobs: int | None,
                    tools: ToolRequest | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
    """Build and validate SamplingParams (ValueError -> 400). `max_tokens` None = fill the
    context; `prompt_logprobs` None = the body's. Limits that depend on the server (n, logprobs,
    prompt_logprobs, max_tokens against the prompt) are the engine's entry checks
    (`InputProcessor`), which the ingress runs next."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")
    if body.stream and body.prompt_logprobs:  # vLLM's rule: a stream has no place for them
        raise OpenAIError(400, "prompt_logprobs are not available with stream=true", "prompt_logprobs")
    reject_unsupported(body)
    constraint = structured_outputs(body)
    forced = tools.constraint() if tools is not None else None
    if forced is not None and constraint is not None:
        raise OpenAIError(400, f"tool_choice={tools.named or tools.choice!r} constrains the output itself; it cannot "
                               "be combined with response_format, structured_outputs or guided_*", "tool_choice")
    bias = None
    if body.logit_bias is not None:
        try:
            bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        except ValueError as exc:
            raise OpenAIError(400, f"logit_bias keys must be token ids, got {list(body.logit_bias)[:8]}",
                              "logit_bias") from exc
    extra = {**(body.extra_args or {}), **(body.vllm_xargs or {})} or None
    fields: dict[str, Any] = dict(
        n=body.n, max_tokens=max_tokens, stop=body.stop, seed=body.seed, logprobs=logprobs,
        min_tokens=body.min_tokens, stop_token_ids=body.stop_token_ids, ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        allowed_token_ids=body.allowed_token_ids, bad_words=body.bad_words,
        prompt_logprobs=body.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
        logit_bias=bias, extra_args=extra,
        structured_outputs=forced or constraint, thinking_token_budget=body.thinking_token_budget)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        value = getattr(body, name)
        if value is not None:
            fields[name] = value
    try:
        return SamplingParams(**fields)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(400, str(exc)) from exc


def completion_params(req: CompletionRequest) -> SamplingParams:
    if req.suffix is not None:
        raise OpenAIError(400, "suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise OpenAIError(400, f"best_of must equal n (beam search is not supported), got {req.best_of}",
                          "best_of")
    if req.max_tokens == 0 and not req.echo:
        raise OpenAIError(400, "max_tokens must be at least 1 (0 is allowed only with echo=true)", "max_tokens")
    return sampling_params(req, max_tokens=completion_max_tokens(req), logprobs=req.logprobs,
                           prompt_logprobs=echo_prompt_logprobs(req))


def completion_max_tokens(req: CompletionRequest) -> int:
    """OpenAI's default of 16; `max_tokens: 0` with echo runs one token, which the answer
    leaves out (vLLM's way to score a prompt without generating)."""
    if req.max_tokens is None:
        return 16
    return max(req.max_tokens, 1)


def echo_prompt_logprobs(req: CompletionRequest) -> int | None:
    """echo with logprobs scores the echoed prompt too (with `logprobs` alternatives per
    position, as vLLM does) unless prompt_logprobs is given."""
    if req.prompt_logprobs is None and req.echo:
        return req.logprobs
    return req.prompt_logprobs


def echo_only(req: CompletionRequest) -> bool:
    """The answer is the prompt alone: `echo` with `max_tokens: 0`."""
    return req.echo and req.max_tokens == 0


def chat_params(req: ChatCompletionRequest, tools: ToolRequest | None = None) -> SamplingParams:
    """`tools`: the request's `chat_tools(req)` when the caller has it already."""
    tools = tools if tools is not None else chat_tools(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, tools=tools)
