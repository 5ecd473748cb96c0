"""OpenAI request bodies (plus vLLM's extra fields) and their translation to SamplingParams.

Pure functions and pydantic models: no Ray, no engine. The ingress parses a body with
these models, builds `SamplingParams` with `sampling_params()` and then runs the engine's
own entry checks (`InputProcessor`), so every bad request is an HTTP 400 here.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from cluster.sampling_params import SamplingParams, StructuredOutputsParams


class OpenAIError(Exception):
    """An error answered as OpenAI's error JSON with this HTTP status."""

    TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
             500: "InternalServerError", 503: "ServiceUnavailableError"}

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "Error"),
                          "param": self.param, "code": self.status}}


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
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    user: str | None = None
    priority: int = 0  # vLLM's: lower first, with scheduling_policy "priority"
    response_format: ResponseFormat | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    structured_outputs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    # Per-request arguments for custom logits processors (vLLM's name, and ours).
    vllm_xargs: dict[str, Any] | None = None
    extra_args: dict[str, Any] | None = None


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    add_special_tokens: bool = True


class ChatCompletionRequest(_SamplingBody):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


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
    """`structured_outputs` (vLLM) or `response_format` (OpenAI); giving both is ambiguous."""
    spec = None
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        spec = {"json_object": True}
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise OpenAIError(400, "response_format json_schema needs json_schema.schema", "response_format")
        spec = {"json": rf.json_schema.json_schema}
    elif rf is not None and rf.type == "structural_tag":
        spec = {"structural_tag": rf.model_dump(exclude={"type"}, exclude_none=True)}
    if body.structured_outputs is not None:
        if spec is not None:
            raise OpenAIError(400, "give either response_format or structured_outputs, not both",
                              "structured_outputs")
        spec = body.structured_outputs
    if spec is None:
        return None
    try:
        return StructuredOutputsParams(**spec)
    except (TypeError, ValueError) as exc:
        raise OpenAIError(400, f"structured_outputs: {exc}", "structured_outputs") from exc


def sampling_params(body: _SamplingBody, *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    """Build and validate SamplingParams (ValueError -> 400). `max_tokens` None = fill the
    context. Limits that depend on the server (n, logprobs, max_tokens against the prompt)
    are the engine's entry checks (`InputProcessor`), which the ingress runs next."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(400, "stream_options is only allowed with stream=true", "stream_options")
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
        prompt_logprobs=body.prompt_logprobs, logit_bias=bias, extra_args=extra,
        structured_outputs=structured_outputs(body), thinking_token_budget=body.thinking_token_budget)
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
    if req.echo and req.logprobs is not None:
        raise OpenAIError(400, "echo with logprobs is not supported", "echo")
    return sampling_params(req, max_tokens=req.max_tokens if req.max_tokens is not None else 16,
                           logprobs=req.logprobs)


def chat_params(req: ChatCompletionRequest) -> SamplingParams:
    if req.tools and req.tool_choice != "none":
        raise OpenAIError(400, "tool calling is not supported by this server", "tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return sampling_params(req, max_tokens=max_tokens, logprobs=logprobs)
