"""The OpenAI-compatible front end: a stateless FastAPI Serve deployment (`ingress`, N replicas).

The routes. Per request they authenticate, parse the OpenAI body (actors/http/openai_protocol.py),
apply the chat template, tokenize and run the engine's own entry checks, so bad input is a 400
that never reaches the engine. Then actors/http/streams.py takes over: it sends the prompts to
the engine deployment, follows their outputs and writes the SSE chunks or the JSON answer
(actors/http/openai_format.py). `stream_interval` sets the tokens per SSE chunk after the first.
"""
# No `from __future__ import annotations`: FastAPI must see the route parameters' real types
# (Serve re-wraps the methods, so string annotations would not resolve).
import asyncio
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from ray import serve

from actors.http.body_limit import BodyLimitMiddleware, set_max_body_bytes
from actors.http.chat_parsers import ChatParsing
from actors.http.openai_format import ChatFormat, CompletionFormat
from actors.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                         TokenizeRequest, chat_params, chat_tools, completion_params,
                                         completion_prompts)
from actors.http.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, HEALTH_RESPONSES, install_openapi
from actors.http.streams import EngineStreams, PromptState, engine_error
from actors.metrics import RequestMetrics
from cluster.messages import EngineRequest
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import content_chars

API_KEY_ENV = "LLM_CLUSTER_API_KEY"
app = FastAPI(title="llm-cluster", description="OpenAI-compatible API served by llm-cluster")
app.add_middleware(BodyLimitMiddleware)
install_openapi(app)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"{where}: {first.get('msg', 'invalid request')}" if where else str(first.get("msg", exc))
    return JSONResponse(OpenAIError(400, message, where or None).body(), status_code=400)


# Defined last: @serve.ingress snapshots the FastAPI app (and the globals its routes use)
# when the class is decorated, so everything the routes call must exist by then.
@serve.deployment(name="ingress")
@serve.ingress(app)
class Ingress:
    async def __init__(self, engine, config, api_key: str | None = None, tool_call_parser: str | None = "hermes",
                       stream_interval: int = 1) -> None:
        from cluster.engine.input_processor import InputProcessor

        set_max_body_bytes(config.limits_config.max_request_body_bytes)
        self.engine, self.config = engine, config
        self.tool_call_parser = tool_call_parser  # parses tool_choice="auto" answers (actors/http/tool_parser.py)
        self.model_name = config.model_config.name
        self.tokenizer = config.model_config.get_tokenizer()
        self.inputs = InputProcessor(config)
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.metrics = RequestMetrics(self.model_name)
        self.streams = EngineStreams(engine, self.tokenizer, self.metrics, stream_interval)
        self.created = int(time.time())
        # Ready only once an engine replica is (it warms itself up): otherwise the first
        # requests after `serve run` would wait seconds for the model to load.
        await self.engine.health.remote()

    # ---- small endpoints ----------------------------------------------------------------
    @app.get("/health", responses=HEALTH_RESPONSES, response_class=Response)
    async def health(self) -> Response:
        """200 with an empty body when an engine replica answers; 503 otherwise."""
        try:
            await asyncio.wait_for(self.engine.health.remote(), 10.0)
        except Exception as exc:
            return JSONResponse(engine_error(exc).body() | {"status": "unhealthy"}, status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(self, request: Request) -> dict:
        self._authorize(request)
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "llm-cluster",
                "root": self.config.model_config.model, "max_model_len": self.config.model_config.max_model_len}
        return {"object": "list", "data": [card]}

    @app.get("/engine/stats", responses=ERROR_RESPONSES)
    async def engine_stats(self, request: Request) -> dict:
        """Operator view of one engine replica: running / waiting, KV blocks, counters."""
        self._authorize(request)
        try:
            return await self.engine.stats.remote()
        except Exception as exc:
            raise engine_error(exc) from exc

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        self._authorize(request)
        self._check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            ids = self._chat_ids(body.messages, body.add_generation_prompt, {})
        else:
            ids = self._encode(body.prompt, body.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.config.model_config.max_model_len, "tokens": ids}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self._authorize(request)
        self._check_model(body.model)
        try:
            self.inputs.check_prompt(body.tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "tokens") from exc
        return {"prompt": self.tokenizer.decode(body.tokens)}

    # ---- generation ---------------------------------------------------------------------
    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._authorize(request)
        self._check_model(body.model)
        params = completion_params(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = []
        for i, p in enumerate(completion_prompts(body)):
            ids = self._encode(p, body.add_special_tokens) if isinstance(p, str) else p
            prompts.append(self._prepare(f"{rid}-{i}", p if isinstance(p, str) else None, ids, params,
                                         body.priority, arrival))
        # Several prompts are one client's request: one share of the batch between them.
        await self.streams.start(prompts, body.priority, rid if len(prompts) > 1 else None)
        fmt = CompletionFormat(self.tokenizer, self.model_name, rid, body.echo)
        if body.stream:
            return self.streams.sse(prompts, fmt, body.stream_options)
        return await self.streams.collect(prompts, fmt)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._authorize(request)
        self._check_model(body.model)
        tools = chat_tools(body)
        params = chat_params(body, tools)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None and tools.choice != "none":
            kwargs["tools"] = body.tools
        ids = self._chat_ids(body.messages, body.add_generation_prompt and not body.continue_final_message, kwargs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompts = [self._prepare(rid, None, ids, params, body.priority, arrival)]
        await self.streams.start(prompts, body.priority)
        parsing = ChatParsing.for_request(self.config, tools, self.tool_call_parser, body.include_reasoning)
        fmt = ChatFormat(self.tokenizer, self.model_name, rid, parsing)
        if body.stream:
            return self.streams.sse(prompts, fmt, body.stream_options)
        return await self.streams.collect(prompts, fmt)

    # ---- helpers ------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise OpenAIError(404, f"The model `{model}` does not exist; this server serves "
                                   f"`{self.model_name}`.", "model")

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_text(len(text), "prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_text(self, num_chars: int, field: str) -> None:
        try:  # before tokenizing: a multi-megabyte prompt would take seconds
            self.inputs.check_text(num_chars, field)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), field) from exc

    def _chat_ids(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict) -> list[int]:
        reserved = sorted({"tokenize", "add_generation_prompt", "conversation", "messages"} & set(kwargs))
        if reserved:
            raise OpenAIError(400, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
        self._check_text(content_chars(messages), "messages")
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=True, **kwargs)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "messages") from exc

    def _prepare(self, rid: str, text: str | None, ids: list[int], params: SamplingParams,
                 priority: int, arrival: float) -> PromptState:
        try:
            checked = self.inputs.process(EngineRequest(rid, ids, params, priority=priority))
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc
        return PromptState(rid, text, ids, checked.sampling_params, arrival=arrival)
