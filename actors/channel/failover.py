"""Failover in the ingress: a request that an engine replica could not serve, and that has not
produced a token yet, goes to another replica, so the client never sees the failure.

Retried: `EngineUnavailableError` (the replica's step loop failed: a dead worker; the replica
refuses all work until Serve replaces it) and Ray's actor errors (the replica process died or
cannot be reached). Each retry names the replicas that refused in `avoid_replicas`, which the
engine routers (actors/fleet/router.py) honour, and is counted in `ray_llm_requests_retried_total`.
Not retried: bad input (400), a full queue (503: every replica would be as busy soon) and
`EngineInternalError` (500: an engine bug the same request would hit on every replica).

Once a stream has sent tokens a failure is the client's to see: the ingress ends the stream
with an OpenAI-shaped error event, never a hang. A whole (non-streamed) answer has shown the
client nothing until it ends, so a request whose copy fails after its first tokens is sent
again, whole, to another copy (actors/http/streams.py, `EngineStreams.collect`).
"""
from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from ray.exceptions import RayActorError

from actors.channel.protocol import AVOID_REPLICAS, EngineUnavailableError
from actors.metrics import RequestMetrics


T = TypeVar("T")


def outside_the_request(call: Callable[[], T]) -> T:
    """Make a handle call in a fresh context, so Serve does not tie it to the HTTP request being
    served. With gRPC handles (Serve's throughput mode, actors/env.py) Serve cancels every call a
    request made when that request is cancelled: a client going away. An engine call carries
    other requests' outputs after its first item (actors/channel/mux.py), and a message cut in
    flight would stall every later stream of this ingress, so only the ingress ends such a call:
    it aborts the request and the call ends by itself. Before the first item `Failover.open`
    cancels the call itself. The price: Serve's logs of the call do not carry the HTTP request's
    id (the engine request id, in the call's payload, still names it)."""
    return contextvars.Context().run(call)


def retryable(exc: BaseException) -> bool:
    return isinstance(exc, (EngineUnavailableError, RayActorError))


def refused_by(exc: BaseException) -> str | None:
    """The engine replica named by an EngineUnavailableError (Ray may wrap it; the cause has it)."""
    for e in (exc, getattr(exc, "cause", None)):
        replica = getattr(e, "replica", None) if isinstance(e, EngineUnavailableError) else None
        if replica:
            return replica
    return None


@dataclass
class Failover:
    engine: Any  # DeploymentHandle of the engine deployment
    metrics: RequestMetrics
    max_attempts: int = 3
    backoff_s: float = 0.1  # before attempt k + 1: k * backoff_s

    async def open(self, request: bytes, avoid: tuple[str, ...] = (), **kwargs: Any) -> tuple[Any, bytes]:
        """(engine stream, its first item) for one msgpack EngineRequest, on a replica not in
        `avoid`; `kwargs` go to `generate`. The first item holds the first token(s), so everything
        raised before it is a failure no client has seen."""
        avoid = list(avoid)
        for attempt in range(1, self.max_attempts + 1):
            stream = outside_the_request(lambda: self.engine.options(stream=True).generate.remote(
                request, **{AVOID_REPLICAS: tuple(avoid)}, **kwargs))
            try:
                return stream, await stream.__anext__()
            except BaseException as exc:
                stream.cancel()
                if attempt == self.max_attempts or not retryable(exc):
                    raise
                replica = refused_by(exc)
                if replica and replica not in avoid:
                    avoid.append(replica)
                self.metrics.retry()
                await asyncio.sleep(self.backoff_s * attempt)
        raise AssertionError("unreachable")
