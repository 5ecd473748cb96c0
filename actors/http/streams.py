"""The HTTP side of a request's engine streams, in the ingress: from its prompts' engine
requests to the last byte of the answer.

`EngineStreams.start` opens one engine stream per prompt through the channel
(actors/channel/ingress.py) and waits for each first item, so a refusal (bad input, queue
full, engine down) is still an HTTP status code. Here the outputs are grouped `stream_interval`
tokens at a time after the first (vLLM's --stream-interval), detokenized with stop strings
applied (one `OutputProcessor` per prompt), and written as SSE chunks (`sse`) or one JSON body
(`collect`) in the shapes of actors/http/openai_format.py.

Guarantee: whatever ends a prompt early (a stop string, the client going away, an error)
closes its stream, which aborts it in the engine and frees its blocks. A whole (non-streamed)
answer whose engine copy fails is sent again to another copy: its client has seen nothing yet.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
from fastapi.responses import Response, StreamingResponse

from actors.channel.ingress import IngressChannel, StreamEndedEarly
from actors.channel.protocol import EngineUnavailableError
from actors.http.prompt import PromptState
from actors.http.openai_protocol import OpenAIError, output_error, retry_later
from actors.metrics import RequestMetrics
from cluster.errors import QUEUE_TIMEOUT, EngineOverloadedError
from cluster.lora.registry import LoRANotFoundError
from cluster.messages import EngineOutput, EngineRequest
from cluster.outputs import RequestOutput
from cluster.tokenizer import Tokenizer

if TYPE_CHECKING:
    from actors.http.openai_format import OpenAIFormat

logger = logging.getLogger("ray.serve")


def engine_error(exc: BaseException) -> OpenAIError:
    """Map what the engine handle raised to the HTTP answer."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (EngineOverloadedError, BackPressureError)):  # busy now: try again soon
        return retry_later(f"the engine is overloaded: {_cause(exc)}")
    if isinstance(exc, (EngineUnavailableError, DeploymentUnavailableError, RayActorError)):
        return OpenAIError(503, f"the engine is unavailable: {_cause(exc)}")
    if isinstance(exc, LoRANotFoundError):  # the adapter's folder went away after the ingress saw it
        return OpenAIError(404, _cause(exc), "model", code="model_not_found")
    if isinstance(exc, StreamEndedEarly):
        return OpenAIError(500, str(exc))
    if isinstance(exc, ValueError):
        return OpenAIError(400, _cause(exc))
    logger.error("internal error answered with 500: %r", exc)
    return OpenAIError(500, f"internal error: {_cause(exc)}")


def _cause(exc: BaseException) -> str:
    # RayTaskError(X) prints the remote traceback; its cause holds the message alone.
    cause = getattr(exc, "cause", None)
    return str(cause if isinstance(cause, BaseException) else exc).strip().splitlines()[-1]


class EngineStreams:
    """The engine streams of one ingress replica's requests (`engine`: the engine deployment's
    handle); `stream_interval` is the tokens per SSE chunk after the first."""

    def __init__(self, engine: Any, tokenizer: Tokenizer, metrics: RequestMetrics, stream_interval: int = 1) -> None:
        self.tokenizer, self.metrics, self.stream_interval = tokenizer, metrics, stream_interval
        self.channel = IngressChannel(engine, metrics)

    async def start(self, prompts: list[PromptState], priority: int = 0, group_id: str | None = None) -> None:
        """Open every prompt's engine stream and wait for each first item, so a rejection (bad
        input, queue full, engine down) is still an HTTP status code."""
        requests = [EngineRequest(p.request_id, p.token_ids, p.params, arrival_time=time.time(), priority=priority,
                                  group_id=group_id, lora_request=p.lora_request) for p in prompts]
        try:
            streams = await self.channel.open(requests)
        except Exception as exc:
            raise engine_error(exc) from exc
        for p, stream in zip(prompts, streams):
            p.stream = stream
        # A queue deadline ends a request before its first step: still a status code (503).
        late = [o for s in streams for o in s.first if o.error_code == QUEUE_TIMEOUT]
        if late:
            self.cancel(prompts)
            raise output_error(late[0].error, late[0].error_code)

    def cancel(self, prompts: list[PromptState]) -> None:
        """Close every prompt's stream: what the engine still runs is aborted."""
        for p in prompts:
            if p.stream is not None:
                p.stream.close()

    async def _outputs(self, p: PromptState) -> AsyncIterator[RequestOutput]:
        """RequestOutputs of one prompt until it finishes; a stop string aborts it in the engine,
        and the stream is closed however this ends (the consumer going away included)."""
        from cluster.engine.output_processor import OutputProcessor

        processor = OutputProcessor(self.tokenizer)
        # The engine request's id: the prompt's own, or `<id>~retry<k>` once it was sent again.
        processor.add(p.stream.request_id, p.text, p.token_ids, p.params)
        timing = _Timing(p.arrival)
        try:
            batch = p.stream.first
            while True:
                outs, to_abort = processor.process(batch)
                if to_abort:  # a stop string: the engine still runs it
                    p.stream.abort()
                for out in outs:
                    timing.observe(self.metrics, out)
                    yield out
                    if out.finished:
                        p.final = out
                        return
                batch = await p.stream.next(self.stream_interval)
        finally:
            p.stream.close()

    def follow(self, prompts: list[PromptState]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, RequestOutput) as the prompts' outputs come, until every prompt has
        finished; for streamed answers other than `sse` (the Responses API). A caller that
        stops early calls `cancel(prompts)`, which aborts what the engine still runs."""
        return _merge([self._outputs(p) for p in prompts])

    async def whole(self, prompts: list[PromptState]) -> None:
        """Read every prompt to its end (`p.final`), for a whole answer: a prompt whose engine
        copy fails meanwhile is sent again to another (its client has seen nothing). Raises the
        HTTP error of a failure it cannot recover from, after aborting the prompts."""
        async with self._aborting(prompts):
            for p in prompts:  # engine streams run concurrently; reading in order is fine
                await self._finish(p)

    async def collect(self, prompts: list[PromptState], fmt: OpenAIFormat) -> Response:
        """The whole answer as one JSON body, once every prompt finished."""
        await self.whole(prompts)
        failed = [p.final for p in prompts if p.final.error]
        if failed:
            raise output_error(failed[0].error, failed[0].error_code)
        return Response(msgspec.json.encode(fmt.response(prompts)), media_type="application/json")

    @contextlib.asynccontextmanager
    async def _aborting(self, prompts: list[PromptState]) -> AsyncIterator[None]:
        """Around reading answers no client has seen: if the client goes away, or the engine
        fails past recovery, abort the prompts in the engine; the failure becomes its HTTP error."""
        try:
            yield
        except asyncio.CancelledError:
            self.cancel(prompts)
            raise
        except Exception as exc:
            self.cancel(prompts)
            raise engine_error(exc) from exc

    async def _finish(self, p: PromptState) -> None:
        """Read a prompt of a whole answer to its end. Its client has seen none of it, so if the
        engine copy serving it fails (dead, stuck or frozen), it is sent again to another copy."""
        for attempt in itertools.count(1):
            try:
                async for _ in self._outputs(p):
                    pass
                return
            except Exception as exc:
                if not self.channel.retryable(exc, attempt):
                    raise
                logger.warning("request %s: engine replica %s failed mid-answer; sending it again (%r)",
                               p.request_id, p.stream.replica, exc)
                p.stream = await self.channel.resend(p.stream, exc, attempt)

    async def pooled(self, prompts: list[PromptState]) -> list[list[float]]:
        """Each prompt's pooled vector (an embedding model's), once its prompt completed; a copy
        that fails meanwhile is left for another (nothing reached the client yet)."""
        async with self._aborting(prompts):
            return [await self._pooled_one(p) for p in prompts]

    async def _pooled_one(self, p: PromptState) -> list[float]:
        for attempt in itertools.count(1):
            try:
                return await _read_pooled(p.stream)
            except Exception as exc:
                if not self.channel.retryable(exc, attempt):
                    raise
                p.stream = await self.channel.resend(p.stream, exc, attempt)

    def sse(self, prompts: list[PromptState], fmt: OpenAIFormat, options) -> StreamingResponse:
        """The answer as server-sent events, prompts interleaved as their outputs come."""
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
                self.cancel(prompts)  # client gone (or done): abort what the engine still runs
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


async def _read_pooled(stream) -> list[float]:
    outs = list(stream.first)
    while not any(o.finished for o in outs):
        outs += await stream.next()
    stream.close()
    done = next(o for o in outs if o.finished)
    if done.embedding is None:  # ended before its prompt completed (a deadline, an abort)
        raise output_error(done.error or f"request {stream.request_id} ended without an embedding", done.error_code)
    return done.embedding


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
