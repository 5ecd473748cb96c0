"""The OpenAI-compatible front end: a stateless FastAPI Serve deployment (`ingress`, N replicas).

The routes. Per request they authenticate, parse the OpenAI body (actors/http/openai_protocol.py),
find the model it names among the served ones (actors/http/served.py: an unknown one is a 404
`model_not_found`), apply that model's chat template, tokenize and run its engine's entry checks,
so bad input is a 400 that never reaches an engine. Then actors/http/streams.py takes over: it
sends the prompts to that model's engine deployment, follows their outputs and writes the SSE
chunks or the JSON answer (actors/http/openai_format.py).
"""
# No `from __future__ import annotations`: FastAPI must see the route parameters' real types
# (Serve re-wraps the methods, so string annotations would not resolve).
import asyncio
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from ray import serve

from actors.http import anthropic_api, embeddings
from actors.http.embeddings import EmbeddingRequest
from actors.http.body_limit import BodyLimitMiddleware, set_max_body_bytes
from actors.http.drain import InFlightGate
from actors.http.chat_parsers import ChatParsing
from actors.http.openai_format import ChatFormat, CompletionFormat
from actors.http.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                         LoadLoRAAdapterRequest, OpenAIError, TokenizeRequest,
                                         UnloadLoRAAdapterRequest, chat_params, chat_tools, completion_params,
                                         completion_prompts)
from actors.http.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, HEALTH_RESPONSES, install_openapi
from actors.http.responses import ResponsesRequest
from actors.http.responses_api import ResponsesAPI
from actors.http.served import ModelSpec, ModelTable, ServedModel, Target
from actors.http.streams import engine_error

API_KEY_ENV = "LLM_CLUSTER_API_KEY"
app = FastAPI(title="llm-cluster", description="OpenAI-compatible API served by llm-cluster")
app.add_middleware(BodyLimitMiddleware)
app.add_middleware(InFlightGate)  # outermost: counts every request, refuses new ones while draining
install_openapi(app)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


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
    async def __init__(self, models: list[ModelSpec], api_key: str | None = None, response_store=None) -> None:
        # Bodies are refused by size before parsing, so before the model is known: the largest limit.
        set_max_body_bytes(max(m.config.limits_config.max_request_body_bytes for m in models))
        self.served = ModelTable([ServedModel(m) for m in models])
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.created = int(time.time())
        # serve_cli's graceful shutdown reads this replica's requests in flight (actors/http/drain.py).
        replica = serve.get_replica_context().replica_id.unique_id
        self.drain_reporter = asyncio.get_running_loop().create_task(InFlightGate.report_forever(replica))
        # The Responses API; `response_store`: the `response-store` deployment's handle, or None (off).
        self.responses = ResponsesAPI(response_store)
        # Ready only once every model has an engine replica up (each warms itself up): otherwise
        # the first requests after `serve run` would wait seconds for a model to load.
        await asyncio.gather(*[m.engine.health.remote() for m in self.served])

    # ---- small endpoints ----------------------------------------------------------------
    @app.get("/health", responses=HEALTH_RESPONSES, response_class=Response)
    async def health(self) -> Response:
        """200 with an empty body when every model has an engine replica answering; 503 naming
        the first model that has none otherwise."""
        models = list(self.served)
        results = await asyncio.gather(*[asyncio.wait_for(m.engine.health.remote(), 10.0) for m in models],
                                       return_exceptions=True)
        for model, result in zip(models, results):
            if isinstance(result, BaseException):
                error = engine_error(result)
                error.message = f"model `{model.name}`: {error.message}"
                return JSONResponse(error.body() | {"status": "unhealthy"}, status_code=503)
        return Response(status_code=200)

    @app.get("/v1/models", responses=ERROR_RESPONSES)
    async def models(self, request: Request) -> dict:
        """Every served model, in the order the app lists them, each followed by its adapters."""
        self._authorize(request)
        data = []
        for m in self.served:
            data += [m.card(self.created), *m.adapters.cards(self.created)]
        return {"object": "list", "data": data}

    @app.post("/v1/load_lora_adapter", responses=ERROR_RESPONSES, response_class=PlainTextResponse)
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        """vLLM's: serve the PEFT folder `lora_path` as `lora_name` (from this ingress replica).
        Off (404) unless the operator allows it, and then only from allowed folders (docs/lora.md)."""
        self._authorize(request)
        m = self.served.lora_model(body.model)
        if body.lora_name in self.served.by_name:
            raise OpenAIError(400, f"`{body.lora_name}` is the name of a served model", "lora_name")
        return PlainTextResponse(await asyncio.to_thread(m.adapters.load, body.lora_name, body.lora_path))

    @app.post("/v1/unload_lora_adapter", responses=ERROR_RESPONSES, response_class=PlainTextResponse)
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
        self._authorize(request)
        return PlainTextResponse(self.served.lora_model(body.model).adapters.unload(body.lora_name))

    @app.get("/v1/models/{model:path}", responses=ERROR_RESPONSES)
    async def model(self, model: str, request: Request) -> dict:
        self._authorize(request)
        return self.served.get(model).card(self.created)

    @app.get("/engine/stats", responses=ERROR_RESPONSES)
    async def engine_stats(self, request: Request, model: str | None = None) -> dict:
        """Operator view of one engine replica of `model` (default: the first model): running /
        waiting, KV blocks, counters."""
        self._authorize(request)
        engine = self._model(model).model.engine
        try:
            return await engine.stats.remote()
        except Exception as exc:
            raise engine_error(exc) from exc

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(self, body: TokenizeRequest, request: Request) -> dict:
        self._authorize(request)
        m = self._model(body.model).model
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError(400, "give exactly one of prompt or messages")
        if body.messages is not None:
            ids = m.chat_ids(body.messages, *body.chat_kwargs())
        else:
            ids = m.encode(body.prompt, body.add_special_tokens)
        out = {"count": len(ids), "max_model_len": m.config.model_config.max_model_len, "tokens": ids}
        if body.return_token_strs:
            out["token_strs"] = m.tokenizer.hf.convert_ids_to_tokens(ids)
        return out

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(self, body: DetokenizeRequest, request: Request) -> dict:
        self._authorize(request)
        m = self._model(body.model).model
        try:
            m.inputs.check_prompt(body.tokens)
        except ValueError as exc:
            raise OpenAIError(400, str(exc), "tokens") from exc
        return {"prompt": m.tokenizer.decode(body.tokens)}

    # ---- generation ---------------------------------------------------------------------
    @app.post("/v1/completions", responses=GENERATION_RESPONSES)
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._authorize(request)
        target = self._model(body.model, "completions")
        m = target.model
        params = completion_params(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = []
        for i, p in enumerate(completion_prompts(body)):
            ids = m.encode(p, body.add_special_tokens) if isinstance(p, str) else p
            prompts.append(m.prepare(f"{rid}-{i}", p if isinstance(p, str) else None, ids, params,
                                     body.priority, arrival, target.lora))
        # Several prompts are one client's request: one share of the batch between them.
        await m.streams.start(prompts, body.priority, rid if len(prompts) > 1 else None)
        fmt = CompletionFormat.for_request(m.tokenizer, target.name, rid, body)
        if body.stream:
            return m.streams.sse(prompts, fmt, body.stream_options)
        return await m.streams.collect(prompts, fmt)

    @app.post("/v1/chat/completions", responses=GENERATION_RESPONSES)
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._authorize(request)
        target = self._model(body.model, "chat_completions")
        m = target.model
        tools = chat_tools(body)
        params = chat_params(body, tools)
        kwargs = dict(body.chat_template_kwargs or {})
        if body.continue_final_message:
            kwargs["continue_final_message"] = True
        if tools is not None and tools.choice != "none":
            kwargs["tools"] = body.tools
        ids = m.chat_ids(body.messages, body.add_generation_prompt and not body.continue_final_message, kwargs)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompts = [m.prepare(rid, None, ids, params, body.priority, arrival, target.lora)]
        await m.streams.start(prompts, body.priority)
        parsing = ChatParsing.for_request(m.config, tools, m.tool_call_parser, body.include_reasoning)
        fmt = ChatFormat(m.tokenizer, target.name, rid, parsing)
        if body.stream:
            return m.streams.sse(prompts, fmt, body.stream_options)
        return await m.streams.collect(prompts, fmt)

    @app.post("/v1/embeddings", responses=GENERATION_RESPONSES)
    async def create_embeddings(self, body: EmbeddingRequest, request: Request) -> dict:
        """An embedding model's vectors (actors/http/embeddings.py)."""
        arrival = time.monotonic()
        self._authorize(request)
        return await embeddings.create(body, self._model(body.model, "embeddings"), arrival)

    # ---- the Responses API (actors/http/responses_api.py) -------------------------------
    @app.post("/v1/responses", responses=GENERATION_RESPONSES)
    async def create_response(self, body: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self._authorize(request)
        return await self.responses.create(body, self._model(body.model, "responses"), arrival)

    @app.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def get_response(self, response_id: str, request: Request) -> Response:
        self._authorize(request)
        return await self.responses.retrieve(response_id)

    @app.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
    async def response_input_items(self, response_id: str, request: Request, limit: int = 20, order: str = "desc",
                                   after: str | None = None, before: str | None = None) -> dict:
        self._authorize(request)
        return await self.responses.input_items(response_id, limit, order, after, before)

    @app.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
    async def delete_response(self, response_id: str, request: Request) -> dict:
        self._authorize(request)
        return await self.responses.delete(response_id)

    # ---- Anthropic's Messages API (actors/http/anthropic_api.py; errors in Anthropic's shape) ----
    @app.post("/v1/messages", **anthropic_api.MESSAGES_DOCS)
    async def anthropic_messages(self, request: Request) -> Response:
        return await anthropic_api.create_message(request, self.served, self.api_key, time.monotonic())

    @app.post("/v1/messages/count_tokens", **anthropic_api.COUNT_TOKENS_DOCS)
    async def anthropic_count_tokens(self, request: Request) -> Response:
        return await anthropic_api.count_tokens(request, self.served, self.api_key)

    # ---- helpers ------------------------------------------------------------------------
    def _authorize(self, request: Request) -> None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            raise OpenAIError(401, "invalid or missing API key (Authorization: Bearer <key>)")

    def _model(self, name: str | None, endpoint: str | None = None) -> Target:
        """The served model (and adapter) a request names (none: the first model); 404
        `model_not_found` otherwise. Its tokenizer, entry checks and engine streams are the
        request's from here on."""
        target = self.served.pick(name)
        if endpoint is not None:
            target.model.metrics.request(endpoint)
        return target
