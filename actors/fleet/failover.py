"""Failover in the ingress: a request that an engine replica could not serve, and that has not
produced a token yet, goes to another replica, so the client never sees the failure.

Retried: `EngineUnavailableError` (the replica's step loop failed: a dead worker; the replica
refuses all work until Serve replaces it) and Ray's actor errors (the replica process died or
cannot be reached). Each retry names the replicas that refused in `avoid_replicas`, which the
engine routers (actors/fleet/router.py) honour, and is counted in `ray_llm_requests_retried_total`.
Not retried: bad input (400), a full queue (503: every replica would be as busy soon) and
`EngineInternalError` (500: an engine bug the same request would hit on every replica).

Once a stream has produced tokens a failure is the client's to see: the ingress ends the
stream with an OpenAI-shaped error event (or answers an error status), never a hang.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayActorError

from actors.engine.protocol import AVOID_REPLICAS, EngineUnavailableError
from actors.metrics import RequestMetrics


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

    async def open(self, request: bytes, **kwargs: Any) -> tuple[Any, bytes]:
        """(engine stream, its first item) for one msgpack EngineRequest; `kwargs` go to
        `generate`. The first item holds the first token(s), so everything raised before it is
        a failure no client has seen."""
        avoid: list[str] = []
        for attempt in range(1, self.max_attempts + 1):
            stream = self.engine.options(stream=True).generate.remote(
                request, **{AVOID_REPLICAS: tuple(avoid)}, **kwargs)
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
