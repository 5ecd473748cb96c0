"""The Anthropic Messages API routes' work: `POST /v1/messages` and
`POST /v1/messages/count_tokens`, on the chat path.

`create_message` turns the body into a chat request (actors/http/anthropic_protocol.py) and runs
it exactly as the chat route does: the model's chat template and tool prompt, the forced-call
grammars, the engine's entry checks (`ServedModel.prepare`), then `EngineStreams`, which aborts
the request in the engine (freeing its KV blocks) when the client goes away. The outputs become
Anthropic's message or its events (actors/http/anthropic_format.py).

Every error is answered in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`,
so the body is read here rather than by FastAPI (whose validation errors are OpenAI's). Bad input
is a 400 before anything is queued. With an API key set, `x-api-key: <key>` (the Anthropic SDK's
header) or `Authorization: Bearer <key>` is accepted.
"""
from __future__ import annotations

import functools
import json
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from actors.http.anthropic_format import MessageBuilder, MessageFormat, error_body, error_status, new_id, sse
from actors.http.anthropic_protocol import (ChatTranslation, CountTokensRequest, MessagesRequest, to_chat,
                                            translate_error)
from actors.http.chat_parsers import ChatParsing
from actors.http.openai_protocol import OpenAIError, chat_params, chat_tools, output_error
from actors.http.prompt import PromptState
from actors.http.streams import engine_error
from actors.http.tool_parser import ToolRequest

# The routes' OpenAPI description: the request body (the models are flat, so their schemas stand
# alone) and Anthropic's error body on every status the routes answer.
_ERROR_SCHEMA = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}
_STATUSES = {400: "Bad input (invalid_request_error)", 401: "Missing or wrong API key (authentication_error)",
             404: "No model of that name is served (not_found_error)", 408: "The request outlasted its deadline",
             500: "An internal error of the engine (api_error)",
             503: "No engine replica can take the request now (overloaded_error)",
             529: "The engine's queue is full (overloaded_error); retry after Retry-After"}
_ERRORS = {status: {"description": text, "content": {"application/json": {"schema": _ERROR_SCHEMA}}}
           for status, text in _STATUSES.items()}


def route_docs(model: type, ok: str) -> dict[str, Any]:
    """`@app.post` keyword arguments documenting a route whose body is read by hand."""
    body = {"required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}
    return {"responses": {200: {"description": ok}, **_ERRORS}, "openapi_extra": {"requestBody": body}}


MESSAGES_DOCS = route_docs(MessagesRequest, "The message as JSON, or with `stream: true` a text/event-stream of "
                                            "Anthropic's events (message_start ... message_stop)")
COUNT_TOKENS_DOCS = route_docs(CountTokensRequest, "`{\"input_tokens\": N}`: the prompt the message would run")


def anthropic_errors(route):
    """Answer the route's OpenAIErrors (its own and the chat path's) in Anthropic's shape."""
    @functools.wraps(route)
    async def wrapped(*args: Any, **kwargs: Any) -> Response:
        try:
            return await route(*args, **kwargs)
        except OpenAIError as exc:
            exc = translate_error(exc)
            return JSONResponse(error_body(exc), status_code=error_status(exc), headers=exc.headers)
    return wrapped


def authorize(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    if request.headers.get("x-api-key") != api_key and request.headers.get("authorization") != f"Bearer {api_key}":
        raise OpenAIError(401, "invalid or missing API key (x-api-key: <key> or Authorization: Bearer <key>)")


async def read_body(request: Request, model: type) -> Any:
    """The JSON body as `model`; a malformed or invalid one is a 400 naming the field."""
    try:
        data = json.loads(await request.body())
    except ValueError as exc:
        raise OpenAIError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise OpenAIError(400, "the body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise OpenAIError(400, f"{where}: {first.get('msg', 'invalid value')}", where or None) from None


def prompt_ids(m: Any, t: ChatTranslation, tools: ToolRequest | None) -> list[int]:
    """The conversation through the model's chat template, as the chat route renders it."""
    kwargs = dict(t.chat.chat_template_kwargs or {})
    if t.prefill:
        kwargs["continue_final_message"] = True
    if tools is not None and tools.choice != "none":
        kwargs["tools"] = t.chat.tools
    return m.chat_ids(t.chat.messages, not t.prefill, kwargs)


@anthropic_errors
async def count_tokens(request: Request, served: Any, api_key: str | None) -> Response:
    """`{"input_tokens": N}`: the tokens of the prompt a message with this body would run."""
    authorize(request, api_key)
    req = await read_body(request, CountTokensRequest)
    m = served.pick(req.model).model
    t = to_chat(req, m.config.reasoning_config is not None)
    return JSONResponse({"input_tokens": len(prompt_ids(m, t, chat_tools(t.chat)))})


@anthropic_errors
async def create_message(request: Request, served: Any, api_key: str | None, arrival: float) -> Response:
    """`served`: the ingress's ModelTable (actors/http/served.py)."""
    authorize(request, api_key)
    req = await read_body(request, MessagesRequest)
    target = served.pick(req.model)
    target.model.metrics.request("messages")
    m = target.model
    t = to_chat(req, m.config.reasoning_config is not None)
    tools = chat_tools(t.chat)
    params = chat_params(t.chat, tools)
    ids = prompt_ids(m, t, tools)
    rid = new_id("msg")
    prompts = [m.prepare(rid, None, ids, params, t.chat.priority, arrival, target.lora)]
    await m.streams.start(prompts, t.chat.priority)
    fmt = MessageFormat(rid, target.name, ChatParsing.for_request(m.config, tools, m.tool_call_parser,
                                                                  t.chat.include_reasoning))
    if req.stream:
        return StreamingResponse(_events(m, prompts, fmt.builder(prompts[0])), media_type="text/event-stream")
    return await m.streams.collect(prompts, fmt)


async def _events(m: Any, prompts: list[PromptState], builder: MessageBuilder) -> AsyncIterator[bytes]:
    """The message as Anthropic's events; an error after the first byte is an `error` event."""
    try:
        for event in builder.start():
            yield sse(event)
        async for _, out in m.streams.follow(prompts):
            c = out.outputs[0]
            if out.error and c.finish_reason == "error":
                raise output_error(out.error, out.error_code)
            for event in builder.feed(c.text_delta, final=c.finish_reason is not None):
                yield sse(event)
        for event in builder.finish(prompts[0].final.outputs[0]):
            yield sse(event)
    except Exception as exc:  # headers are sent: report in-band, as Anthropic does
        yield sse(error_body(translate_error(engine_error(exc))))
    finally:
        m.streams.cancel(prompts)  # the client gone (or done): abort what the engine still runs
