"""Graceful shutdown: the ingress stops taking requests, lets those in flight finish, then Serve stops.

Ray Serve's own shutdown kills the HTTP proxies at once (their shutdown is a no-op before
`ray.kill`), so every open stream would be cut. `python -m actors.serve_cli` (what `make serve`
runs) therefore drains first, on SIGTERM / Ctrl-C:

1. it calls `ShutdownCoordinator.drain()`, a named actor every ingress replica reports to;
2. each replica learns it at its next report (every `REPORT_PERIOD_S`) and from then on answers
   new HTTP requests with 503 and `Retry-After` (so clients and load balancers go elsewhere),
   `/health` included, while the requests it is serving go on to their last byte;
3. once every live replica has reported, after the drain began, that nothing is in flight (or
   the drain timeout passes), serve_cli lets Serve shut down.

`InFlightGate` is the per-replica half: an ASGI middleware counting requests until their
response, streamed bodies included, is fully sent. A replica that stops reporting (dead) stops
counting after `STALE_S`. Without a coordinator (an app started by `serve.run` in a test or a
notebook) the gate only counts.
"""
from __future__ import annotations

import asyncio
import logging
import time

import ray

COORDINATOR_NAME = "llm-cluster-shutdown"
COORDINATOR_NAMESPACE = "serve"
REPORT_PERIOD_S = 0.5
STALE_S = 5.0  # a replica silent this long is gone (its requests with it)
RETRY_AFTER_S = 5
logger = logging.getLogger("ray.serve")


@ray.remote(num_cpus=0)
class ShutdownCoordinator:
    """Holds the drain flag and each ingress replica's last report (time, draining seen, count)."""

    def __init__(self) -> None:
        self.draining = False
        self.reports: dict[str, tuple[float, bool, int]] = {}

    def report(self, replica: str, in_flight: int) -> bool:
        """A replica's count; returns whether to drain. A report made while draining counts."""
        self.reports[replica] = (time.monotonic(), self.draining, in_flight)
        return self.draining

    def drain(self) -> None:
        self.draining = True

    def counts(self) -> dict[str, int]:
        """Requests in flight on each live ingress replica, by replica id, as last reported."""
        return {rid: n for rid, (at, _, n) in self.reports.items() if time.monotonic() - at < STALE_S}

    def in_flight(self) -> int | None:
        """Requests in flight over the live replicas; None while a live one has not reported
        since the drain began (it may still take new requests)."""
        fresh = [r for r in self.reports.values() if time.monotonic() - r[0] < STALE_S]
        if not all(seen for _, seen, _ in fresh):
            return None
        return sum(n for _, _, n in fresh)


def coordinator(create: bool = False):
    """The named coordinator actor, or None if there is none (and `create` is False)."""
    if create:
        return ShutdownCoordinator.options(name=COORDINATOR_NAME, namespace=COORDINATOR_NAMESPACE,
                                           get_if_exists=True, lifetime="detached").remote()
    try:
        return ray.get_actor(COORDINATOR_NAME, namespace=COORDINATOR_NAMESPACE)
    except ValueError:
        return None


def drain(timeout_s: float, poll_s: float = REPORT_PERIOD_S) -> tuple[bool, int | None]:
    """Tell the ingress replicas to drain and wait until nothing is in flight (True) or
    `timeout_s` passes (False, with the last count). No coordinator: nothing to wait for."""
    actor = coordinator()
    if actor is None:
        return True, 0
    ray.get(actor.drain.remote())
    deadline, count = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        count = ray.get(actor.in_flight.remote())
        if count == 0:
            return True, 0
        time.sleep(poll_s)
    return False, count


def forget() -> None:
    """Remove the coordinator once Serve has stopped: a later app on the same cluster (it is a
    detached actor) must not start out draining."""
    actor = coordinator()
    if actor is not None:
        ray.kill(actor)


class InFlightGate:
    """ASGI middleware: counts requests in flight; refuses new ones with 503 while draining."""

    in_flight = 0
    draining = False

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if InFlightGate.draining:
            return await _refuse(send)
        InFlightGate.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            InFlightGate.in_flight -= 1

    @classmethod
    async def report_forever(cls, replica: str) -> None:
        """Report this replica's count to the coordinator until the replica stops."""
        actor = coordinator(create=True)
        while True:
            try:
                cls.draining = await actor.report.remote(replica, cls.in_flight) or cls.draining
            except Exception:  # the coordinator is gone (cluster shutting down): keep serving
                logger.warning("shutdown coordinator unreachable", exc_info=True)
            await asyncio.sleep(REPORT_PERIOD_S)


async def _refuse(send) -> None:
    # Imported here: serve_cli imports this module to drain, at every stop, and the OpenAI types
    # bring the tokenizer's imports with them (transformers, torch: seconds of a stop).
    from actors.http.body_limit import answer
    from actors.http.openai_protocol import OpenAIError

    error = OpenAIError(503, "the server is shutting down: retry on another server")
    await answer(send, error, ((b"retry-after", str(RETRY_AFTER_S).encode()), (b"connection", b"close")))
