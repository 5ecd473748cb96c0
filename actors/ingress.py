"""The OpenAI-compatible front end: a stateless FastAPI Serve deployment (N replicas).

Per request it authenticates, parses, applies the chat template, tokenizes and runs the
engine's own entry checks (so bad input is a 400 that never reaches the engine), then
opens the engine's `generate` call. After the call's first item the request's outputs come
multiplexed with this ingress's other requests, one message per engine step
(actors/demux.py). Detokenization and stop strings run here, one `OutputProcessor` per
request; a stop string or a client disconnect aborts the request in the engine (which frees
its blocks). `stream_interval` sets the tokens per SSE chunk after the first.
"""
# No `from __future__ import annotations`: FastAPI must see the route parameters' real types
# (Serve re-wraps the methods, so string annotations would not resolve).
import asyncio
import logging
import os
import time
import uuid
from typing import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve

from actors.body_limit import BodyLimitMiddleware, set_max_body_bytes
from actors.chat_parsers import ChatParsing
from actors.demux import OutputDemux
from actors.failover import Failover
from actors.metrics import RequestMetrics
from actors.openai_format import ChatFormat, CompletionFormat, OpenAIFormat, PromptState
from actors.openai_protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, OpenAIError,
                                    TokenizeRequest, chat_params, chat_tools, completion_params, completion_prompts)
from actors.openapi import ERROR_RESPONSES, GENERATION_RESPONSES, HEALTH_RESPONSES, install_openapi
from actors.protocol import EngineUnavailableError, decode_first
from cluster.errors import EngineOverloadedError
from cluster.messages import EngineOutput, EngineRequest, encode
from cluster.outputs import RequestOutput
from cluster.sampling_params import SamplingParams
from cluster.tokenizer import content_chars

API_KEY_ENV = "LLM_CLUSTER_API_KEY"
# After a request's engine call ended, how long its last outputs may still take on another call.
ENDED_GRACE_S = 30.0
logger = logging.getLogger("ray.serve")
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


def engine_error(exc: BaseException) -> OpenAIError:
    """Map what the engine handle raised to the HTTP answer."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (EngineOverloadedError, EngineUnavailableError, BackPressureError,
                        DeploymentUnavailableError, RayActorError)):
        return OpenAIError(503, f"the engine is unavailable: {_cause(exc)}")
    if isinstance(exc, ValueError):
        return OpenAIError(400, _cause(exc))
    logger.error("internal error answered with 500: %r", exc)
    return OpenAIError(500, f"internal error: {_cause(exc)}")


def _cause(exc: BaseException) -> str:
    # RayTaskError(X) prints the remote traceback; its cause holds the message alone.
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc).strip().splitlines()[-1]


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' outputs as they come; one prompt needs no tasks."""
    if len(iterators) == 1:
        async for out in iterators[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                queue.put_nowait((i, out))
        except BaseException as exc:
            queue.put_nowait((i, exc))
        finally:
            queue.put_nowait((i, done))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


class _Timing:
    """TTFT, inter-token and end-to-end latency of one prompt, fed to the metrics."""

    def __init__(self, arrival: float) -> None:
        self.arrival, self.last = arrival, None

    def observe(self, metrics: RequestMetrics, out: RequestOutput) -> None:
        now = time.monotonic()
        new = sum(len(c.token_ids_delta) for c in out.outputs)
        if new and self.last is None:
            metrics.first_token(now - self.arrival)
            if new > 1:  # more tokens came with the first: no gap between them and it
                metrics.inter_token(0.0, new - 1)
        elif new:
            metrics.inter_token(now - self.last, new)
        if new:
            self.last = now
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            metrics.finish(now - self.arrival, "error" if out.error else (reasons[0] if reasons else "stop"))


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
        self.tool_call_parser = tool_call_parser  # parses tool_choice="auto" answers (actors/tool_parser.py)
        self.model_name = config.model_config.name
        self.tokenizer = config.model_config.get_tokenizer()
        self.inputs = InputProcessor(config)
        self.api_key = api_key or os.environ.get(API_KEY_ENV) or None
        self.metrics = RequestMetrics(self.model_name)
        self.failover = Failover(engine, self.metrics)
        self.demux = OutputDemux(engine)
        self.stream_interval = stream_interval  # tokens per SSE chunk after the first
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
        await self._start(prompts, body.priority, rid if len(prompts) > 1 else None)
        fmt = CompletionFormat(self.tokenizer, self.model_name, rid, body.echo)
        if body.stream:
            return self._sse(prompts, fmt, body.stream_options)
        return await self._collect(prompts, fmt)

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
        await self._start(prompts, body.priority)
        parsing = ChatParsing.for_request(self.config, tools, self.tool_call_parser, body.include_reasoning)
        fmt = ChatFormat(self.tokenizer, self.model_name, rid, parsing)
        if body.stream:
            return self._sse(prompts, fmt, body.stream_options)
        return await self._collect(prompts, fmt)

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
            checked = self.inputs.process(ids, params, priority)
        except ValueError as exc:
            raise OpenAIError(400, str(exc)) from exc
        return PromptState(rid, text, ids, checked, arrival=arrival)

    async def _start(self, prompts: list[PromptState], priority: int = 0, group_id: str | None = None) -> None:
        """Send every prompt to the engine and wait for each stream's first item, so a
        rejection (bad input, queue full, engine down) is still an HTTP status code. A replica
        that fails before the first token is retried elsewhere (actors/failover.py)."""
        reqs = [encode(EngineRequest(p.request_id, p.token_ids, p.params, arrival_time=time.time(),
                                     priority=priority, group_id=group_id))
                for p in prompts]
        for p in prompts:  # before the calls: outputs on another call may beat the first item
            p.queue = self.demux.register(p.request_id)
        results = await asyncio.gather(*[self.failover.open(r, ingress=self.demux.id) for r in reqs],
                                       return_exceptions=True)
        for p, result in zip(prompts, results):
            if not isinstance(result, BaseException):
                stream, data = result
                first = decode_first(data)
                p.first, p.replica, p.live = first.outputs, first.replica, first.muxed
                if first.muxed:
                    self.demux.follow(p.request_id, first.replica, stream)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self._cancel(prompts)
            raise engine_error(errors[0])

    def _cancel(self, prompts: list[PromptState]) -> None:
        """Abort every prompt the engine may still run; forget their queues."""
        for p in prompts:
            if p.live and p.final is None:
                self.demux.abort(p.request_id, p.replica)
            p.live = False
            self.demux.release(p.request_id)

    async def _next(self, p: PromptState) -> list[EngineOutput]:
        """The prompt's next EngineOutputs: what is queued, at least `stream_interval` new
        tokens unless a completion finishes; raises what the engine call raised."""
        held: list[EngineOutput] = []
        while True:
            items = [await self._get(p)]
            while not p.queue.empty():
                items.append(p.queue.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is OutputDemux.ENDED:
                    p.ended = True
                else:
                    held.append(item)
            if held and (self.stream_interval <= 1 or any(o.finished for o in held)
                    or sum(len(o.new_token_ids) for o in held) >= self.stream_interval):
                return held

    async def _get(self, p: PromptState):
        if not p.ended:
            return await p.queue.get()
        try:  # its call ended: what is left is on another call, or never comes
            return await asyncio.wait_for(p.queue.get(), ENDED_GRACE_S)
        except asyncio.TimeoutError:
            raise OpenAIError(500, f"engine stream for {p.request_id} ended before the request finished") from None

    async def _outputs(self, p: PromptState) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one prompt until it finishes; aborts it in the engine when a stop
        string ends it or the consumer goes away (the engine then frees its blocks)."""
        from cluster.engine.output_processor import OutputProcessor

        processor = OutputProcessor(self.tokenizer)
        processor.add(p.request_id, p.text, p.token_ids, p.params)
        timing = _Timing(p.arrival)
        stopped = False
        try:
            batch, p.first = p.first, None
            while True:
                outs, to_abort = processor.process(batch)
                stopped = stopped or bool(to_abort)
                for out in outs:
                    timing.observe(self.metrics, out)
                    yield out
                    if out.finished:
                        p.final = out
                        return
                batch = await self._next(p)
        finally:
            if stopped and p.live:  # the engine still runs it
                self.demux.abort(p.request_id, p.replica)
                p.live = False
            self._cancel([p])

    async def _collect(self, prompts: list[PromptState], fmt: OpenAIFormat) -> Response:
        try:
            for p in prompts:  # engine streams run concurrently; reading in order is fine
                async for _ in self._outputs(p):
                    pass
        except asyncio.CancelledError:  # the client went away: abort in the engine too
            self._cancel(prompts)
            raise
        except Exception as exc:
            self._cancel(prompts)
            raise engine_error(exc) from exc
        errors = [p.final.error for p in prompts if p.final.error]
        if errors:
            raise OpenAIError(500, errors[0])
        return Response(msgspec.json.encode(fmt.response(prompts)), media_type="application/json")

    def _sse(self, prompts: list[PromptState], fmt: OpenAIFormat, options) -> StreamingResponse:
        include_usage = bool(options and options.include_usage)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for i, out in _merge([self._outputs(p) for p in prompts]):
                    for chunk in fmt.chunks(i, prompts[i], out):
                        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
                if include_usage:
                    yield b"data: " + msgspec.json.encode(fmt.usage_chunk(prompts)) + b"\n\n"
            except Exception as exc:  # headers are sent: report in-band, as OpenAI does
                yield b"data: " + msgspec.json.encode(engine_error(exc).body()) + b"\n\n"
            finally:
                self._cancel(prompts)  # client gone (or done): abort what the engine still runs
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
