"""Ingress side of the multiplexed output stream (the engine side is actors/channel/mux.py).

Each ingress replica has one id; its `generate` calls name it, and every engine replica sends
the outputs of all this ingress's requests after their first item as one `MuxMessage` per
step, on whichever of the ingress's open calls to that replica carries at the moment. Here,
one pump task per open call reads its call and fans each message out, in `seq` order per
engine replica, to per-request queues that the requests' streams read (actors/http/streams.py).

A request's queue is registered before its call is made, so outputs that arrive (on another
call) before the request's own first item wait there. The ingress never cancels a call after
its first item (another request's outputs may be in flight on it): it aborts the request
with an `abort` call pinned to the replica that serves it, and the call then ends by itself.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from actors.channel.protocol import PIN_REPLICA, decode_mux
from actors.channel.failover import outside_the_request
from cluster.messages import EngineOutput

logger = logging.getLogger("ray.serve")


@dataclass
class _Order:
    """Messages of one engine replica not yet delivered because an earlier one is missing."""

    next: int = 0
    early: dict[int, list[EngineOutput]] = field(default_factory=dict)


class OutputDemux:
    ENDED = object()  # queued when a request's own call ended (its last outputs may be on another)

    def __init__(self, engine: Any) -> None:
        self.engine = engine  # DeploymentHandle of the engine deployment
        self.id = uuid.uuid4().hex  # this ingress replica, as the engine replicas know it
        self.queues: dict[str, asyncio.Queue] = {}
        self.orders: dict[str, _Order] = {}  # by engine replica
        self.tasks: set[asyncio.Task] = set()

    def register(self, request_id: str) -> asyncio.Queue:
        """The queue of EngineOutputs (or an exception) for a request about to be sent."""
        queue = self.queues[request_id] = asyncio.Queue()
        return queue

    def release(self, request_id: str) -> None:
        """The handler is done with the request; outputs still coming for it are dropped."""
        self.queues.pop(request_id, None)

    def follow(self, request_id: str, replica: str, stream: Any) -> None:
        """Read a call whose first item was taken until it ends."""
        self._spawn(self._pump(request_id, replica, stream))

    def abort(self, request_id: str, replica: str) -> None:
        """Have the serving replica abort the request (its call then ends); fire and forget."""
        self._spawn(self._abort(request_id, replica))

    async def _pump(self, request_id: str, replica: str, stream: Any) -> None:
        try:
            async for data in stream:
                msg = decode_mux(data)
                self._deliver(replica, msg.seq, msg.outputs)
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(self.ENDED)
        except Exception as exc:  # the replica failed or died: this call's request sees it
            queue = self.queues.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)

    def _deliver(self, replica: str, seq: int, outputs: list[EngineOutput]) -> None:
        order = self.orders.setdefault(replica, _Order())
        order.early[seq] = outputs
        while order.next in order.early:
            for out in order.early.pop(order.next):
                queue = self.queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            order.next += 1

    async def _abort(self, request_id: str, replica: str) -> None:
        try:
            await outside_the_request(lambda: self.engine.abort.remote(request_id, **{PIN_REPLICA: replica}))
        except Exception:  # the replica is gone, and the request with it
            logger.warning("could not abort %s on engine replica %s", request_id, replica, exc_info=True)

    def _spawn(self, coro) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
