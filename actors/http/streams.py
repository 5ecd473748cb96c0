"""The engine side of an HTTP request in the ingress: from its prompts' calls to the last byte.

`EngineStreams.start` sends every prompt of one HTTP request to the engine deployment (through
actors/fleet/failover.py) and waits for each call's first item, so a refusal (bad input, queue
full, engine down) is still an HTTP status code. After that item a prompt's outputs come
multiplexed with this ingress's other requests on the same engine replica, one message per
step (actors/fleet/demux.py sorts them to the prompt's queue). Here they are grouped
`stream_interval` tokens at a time after the first (vLLM's --stream-interval), detokenized
with stop strings applied (one `OutputProcessor` per prompt), and written as SSE chunks
(`sse`) or one JSON body (`collect`) in the shapes of actors/http/openai_format.py.

Guarantee: whatever ends a prompt early (a stop string, the client going away, an error)
aborts it in the engine through an `abort` call pinned to the replica serving it, which frees
its blocks. An engine call is never cancelled after its first item: other requests' outputs
may be on their way on it; it ends by itself once its request is done.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
from fastapi.responses import Response, StreamingResponse

from actors.engine.protocol import EngineUnavailableError, decode_first
from actors.fleet.demux import OutputDemux
from actors.fleet.failover import Failover, refused_by, retryable
from actors.http.prompt import PromptState
from actors.http.openai_protocol import OpenAIError, output_error, retry_later
from actors.metrics import RequestMetrics
from cluster.errors import QUEUE_TIMEOUT, EngineOverloadedError
from cluster.lora.registry import LoRANotFoundError
from cluster.messages import EngineOutput, EngineRequest, encode
from cluster.outputs import RequestOutput
from cluster.tokenizer import Tokenizer

if TYPE_CHECKING:
    from actors.http.openai_format import OpenAIFormat

# After a request's engine call ended, how long its last outputs may still take on another call.
ENDED_GRACE_S = 30.0
RETRY_MARK = "~retry"  # engine request id of a whole answer sent again: <id>~retry<k>
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
        self.failover = Failover(engine, metrics)
        self.demux = OutputDemux(engine)

    async def start(self, prompts: list[PromptState], priority: int = 0, group_id: str | None = None) -> None:
        """Send every prompt to the engine and wait for each stream's first item, so a
        rejection (bad input, queue full, engine down) is still an HTTP status code. A replica
        that fails before the first token is retried elsewhere (actors/fleet/failover.py)."""
        for p in prompts:
            p.priority, p.group_id = priority, group_id
        await self._open(prompts)

    async def _open(self, prompts: list[PromptState], avoid: tuple[str, ...] = ()) -> None:
        reqs = [encode(EngineRequest(p.request_id, p.token_ids, p.params, arrival_time=time.time(),
                                     priority=p.priority, group_id=p.group_id, lora_request=p.lora_request))
                for p in prompts]
        for p in prompts:  # before the calls: outputs on another call may beat the first item
            p.queue = self.demux.register(p.request_id)
        results = await asyncio.gather(*[self.failover.open(r, avoid, ingress=self.demux.id) for r in reqs],
                                       return_exceptions=True)
        for p, result in zip(prompts, results):
            if not isinstance(result, BaseException):
                stream, data = result
                first = decode_first(data)
                p.first, p.replica, p.live = first.outputs, first.replica, first.muxed
                if first.muxed:
                    self.demux.follow(p.request_id, first.replica, stream)
        errors = [r for r in results if isinstance(r, BaseException)]
        # A queue deadline ends a request before its first step: still a status code (503).
        errors += [output_error(o.error, o.error_code) for p in prompts for o in p.first or ()
                   if o.error_code == QUEUE_TIMEOUT]
        if errors:
            self.cancel(prompts)
            raise engine_error(errors[0])

    def cancel(self, prompts: list[PromptState]) -> None:
        """Abort every prompt the engine may still run; forget their queues."""
        for p in prompts:
            if p.live and p.final is None:
                self.demux.abort(p.request_id, p.replica)
            p.live = False
            self.demux.release(p.request_id)

    async def next_outputs(self, p: PromptState) -> list[EngineOutput]:
        """The prompt's next EngineOutputs after its first item: what is queued, at least
        `stream_interval` new tokens unless a completion finishes; raises what the engine call
        raised."""
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
                batch = await self.next_outputs(p)
        finally:
            if stopped and p.live:  # the engine still runs it
                self.demux.abort(p.request_id, p.replica)
                p.live = False
            self.cancel([p])

    def follow(self, prompts: list[PromptState]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, RequestOutput) as the prompts' outputs come, until every prompt has
        finished; for answers other than `collect` / `sse` (the Responses API). A caller that
        stops early calls `cancel(prompts)`, which aborts what the engine still runs."""
        return _merge([self._outputs(p) for p in prompts])

    async def collect(self, prompts: list[PromptState], fmt: OpenAIFormat) -> Response:
        """The whole answer as one JSON body, once every prompt finished."""
        try:
            for p in prompts:  # engine streams run concurrently; reading in order is fine
                await self._finish(p)
        except asyncio.CancelledError:  # the client went away: abort in the engine too
            self.cancel(prompts)
            raise
        except Exception as exc:
            self.cancel(prompts)
            raise engine_error(exc) from exc
        failed = [p.final for p in prompts if p.final.error]
        if failed:
            raise output_error(failed[0].error, failed[0].error_code)
        return Response(msgspec.json.encode(fmt.response(prompts)), media_type="application/json")

    async def _finish(self, p: PromptState) -> None:
        """Read a prompt of a whole answer to its end. Its client has seen none of it, so if the
        engine copy serving it fails (a dead, stuck or frozen copy: `retryable`), it runs again,
        whole and under a new engine request id, on another copy."""
        for attempt in range(1, self.failover.max_attempts + 1):
            try:
                async for _ in self._outputs(p):
                    pass
                return
            except Exception as exc:
                if attempt == self.failover.max_attempts or not retryable(exc):
                    raise
                avoid = tuple({r for r in (refused_by(exc), p.replica) if r})
                logger.warning("request %s: engine replica %s failed mid-answer; sending it again (%r)",
                               p.request_id, avoid, exc)
                self.metrics.retry()
                p.request_id = f"{p.request_id.split(RETRY_MARK)[0]}{RETRY_MARK}{attempt}"
                p.first = p.final = None
                p.ended = False
                await self._open([p], avoid)

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
