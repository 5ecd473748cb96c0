"""The ingress end of the channel: open a request's engine stream, read its outputs, abort it.

`IngressChannel.open(requests)` sends each EngineRequest to the engine deployment and waits for
each call's first item, so a refusal (bad input, a full queue, no engine) is raised before any
answer begins; a replica that fails before the first item is tried again elsewhere
(failover.py). Each request then has a `RequestStream`: its first outputs, and `next()` for the
later ones, which come multiplexed with this ingress's other requests on the same replica
(demux.py sorts them to the stream).

Guarantees: a stream that is closed before its request finished is aborted in the engine (an
`abort` call pinned to its replica, which frees its blocks); an engine call is never cancelled
after its first item, since other requests' outputs may be on their way on it: it ends by itself
once its request is done. The caller closes every stream it opened.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from actors.channel.demux import OutputDemux
from actors.channel.failover import Failover, refused_by, retryable
from actors.channel.protocol import decode_first, encode_request
from cluster.messages import EngineOutput, EngineRequest

# After a request's engine call ended, how long its last outputs may still take on another call.
ENDED_GRACE_S = 30.0
RETRY_MARK = "~retry"  # the engine request id of a request sent again whole: <id>~retry<k>


class StreamEndedEarly(RuntimeError):
    """A request's engine call ended and its remaining outputs never came (an engine bug)."""


@dataclass(eq=False)
class RequestStream:
    """One request's engine stream, open from its first item until `close()`."""

    request: EngineRequest
    replica: str  # the engine replica serving it
    first: list[EngineOutput]  # the outputs its first item brought
    live: bool  # the engine still runs it (not finished, not aborted)
    channel: IngressChannel = field(repr=False)
    queue: asyncio.Queue | None = field(default=None, repr=False)  # later outputs (demux.py)
    ended: bool = False  # its own call ended: what is left comes on another call, or never
    unfinished: int = 0  # completions (of n) the engine has not finished

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def next(self, min_tokens: int = 1) -> list[EngineOutput]:
        """The next outputs: what is queued, at least `min_tokens` new tokens unless a completion
        finishes. Raises what the engine call raised (the replica failed or died)."""
        held: list[EngineOutput] = []
        while True:
            items = [await self._get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            for item in items:
                if isinstance(item, BaseException):
                    raise item
                if item is OutputDemux.ENDED:
                    self.ended = True
                else:
                    held.append(item)
            self._count(held)
            if held and (min_tokens <= 1 or any(o.finished for o in held)
                         or sum(len(o.new_token_ids) for o in held) >= min_tokens):
                return held

    def abort(self) -> None:
        """Have the engine stop running the request (its blocks are freed); idempotent."""
        if self.live:
            self.channel.demux.abort(self.request_id, self.replica)
            self.live = False

    def close(self) -> None:
        """Done with the stream: aborted if the engine still runs it; later outputs dropped."""
        self.abort()
        self.channel.demux.release(self.request_id)

    def _count(self, outputs: list[EngineOutput]) -> None:
        self.unfinished -= sum(o.finished for o in outputs)
        if self.unfinished <= 0:
            self.live = False  # all n finished: nothing left to abort

    async def _get(self):
        if not self.ended:
            return await self.queue.get()
        try:
            return await asyncio.wait_for(self.queue.get(), ENDED_GRACE_S)
        except asyncio.TimeoutError:
            raise StreamEndedEarly(f"engine stream for {self.request_id} ended before the request finished") from None


class IngressChannel:
    """One ingress replica's end of the channel to the engine deployment (`engine`: its handle)."""

    def __init__(self, engine: Any, metrics: Any) -> None:
        self.failover = Failover(engine, metrics)
        self.demux = OutputDemux(engine)
        self.metrics = metrics

    async def open(self, requests: list[EngineRequest], avoid: tuple[str, ...] = ()) -> list[RequestStream]:
        """Send each request (to a replica not in `avoid`) and wait for every first item. If any
        is refused, the others are closed and the first refusal is raised."""
        # Registered before the calls: outputs on another call may beat a request's first item.
        queues = {r.request_id: self.demux.register(r.request_id) for r in requests}
        results = await asyncio.gather(*[self.failover.open(encode_request(r), avoid, ingress=self.demux.id)
                                         for r in requests], return_exceptions=True)
        streams, errors = [], []
        for r, result in zip(requests, results):
            if isinstance(result, BaseException):
                errors.append(result)
                self.demux.release(r.request_id)
                continue
            call, data = result
            first = decode_first(data)
            stream = RequestStream(r, first.replica, first.outputs, first.muxed, self, queues[r.request_id],
                                   unfinished=r.sampling_params.n)
            stream._count(first.outputs)
            if first.muxed:
                self.demux.follow(r.request_id, first.replica, call)
            streams.append(stream)
        if errors:
            for s in streams:
                s.close()
            raise errors[0]
        return streams

    def retryable(self, exc: BaseException, attempt: int) -> bool:
        """Whether a request that failed with `exc` on its `attempt`-th copy may be sent again."""
        return attempt < self.failover.max_attempts and retryable(exc)

    async def resend(self, stream: RequestStream, exc: BaseException, attempt: int) -> RequestStream:
        """Send a failed request again, whole, under a new id (`<id>~retry<k>`), avoiding the
        replica that failed it. Only for a request whose client has seen none of its outputs."""
        stream.close()
        avoid = tuple({r for r in (refused_by(exc), stream.replica) if r})
        self.metrics.retry()
        base = stream.request_id.split(RETRY_MARK)[0]
        request = msgspec.structs.replace(stream.request, request_id=f"{base}{RETRY_MARK}{attempt}",
                                          arrival_time=time.time())
        return (await self.open([request], avoid))[0]
