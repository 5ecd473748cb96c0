"""Engine side of the multiplexed output stream: one message per step per ingress replica.

Every `generate` call of an ingress stays open for its request's whole life (Serve's count
of ongoing requests drives the routers' loads, autoscaling, `max_ongoing_requests` and
draining), but after its first item it carries no per-token items of its own. The outputs of
all that ingress's requests on this replica go into one `OutputMux` buffer, and one of the
open calls, the carrier, yields the whole buffer as one `MuxMessage` whenever it holds
something: one Ray message per step for the ingress instead of one per request per step
(fewer when the ingress reads slower than steps come). When the carrier's request ends, the
carrier hands the role to another open call of the same ingress and returns.

Assumptions: one asyncio loop (the replica's); a call joins only after its first item went
out, so a call cancelled before its first item (the ingress's failover) never held messages.
The ingress never cancels a call after its first item (it aborts through `abort`), nor lets
Serve cancel it with the HTTP request that made it (`outside_the_request` in
actors/channel/failover.py), so no message is lost with a carrier; `cut_calls` in the stats
counts calls ended from outside all the same. Messages of different calls may still arrive out
of order, hence `seq`.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import AsyncIterator

from actors.channel.protocol import MuxMessage, encode_item
from cluster.messages import EngineOutput


@dataclass(eq=False)
class Member:
    """One open `generate` call whose request's outputs go through the mux."""

    request_id: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    done: bool = False  # the request finished (all n) or was aborted


class OutputMux:
    """The outputs of one ingress replica's requests on this engine replica."""

    def __init__(self) -> None:
        self.buffer: list[EngineOutput] = []
        self.members: dict[str, Member] = {}  # open calls that passed their first item, oldest first
        self.carrier: Member | None = None
        self.error: BaseException | None = None
        self.seq = 0
        self.outputs = 0  # EngineOutputs sent, for stats
        self.cut = 0  # calls ended from outside before their request was done, for stats

    def push(self, out: EngineOutput) -> None:
        self.buffer.append(out)
        if self.carrier is not None:
            self.carrier.wake.set()

    def end(self, member: Member) -> None:
        """The member's request is done (its last output, if any, is already pushed)."""
        member.done = True
        member.wake.set()

    def fail(self, exc: BaseException) -> None:
        """Every open call raises `exc` (the replica's step loop failed)."""
        self.error = exc
        for m in self.members.values():
            m.wake.set()

    async def serve(self, member: Member) -> AsyncIterator[bytes]:
        """What `member`'s call yields after its first item: MuxMessages while it carries.
        Returns once its request is done and, if it carried, the buffer is out."""
        self.members[member.request_id] = member
        ended = False
        try:
            while True:
                if self.error is not None:
                    raise self.error
                if self.carrier is None:
                    self.carrier = member
                if self.carrier is member and self.buffer:
                    yield self._take()
                    continue
                if member.done:
                    ended = True
                    return
                member.wake.clear()
                await member.wake.wait()
        finally:
            # Cut (cancelled or closed): a carrier's message may have been lost in flight.
            self.cut += not ended and self.error is None
            del self.members[member.request_id]
            if self.carrier is member:  # hand over: the oldest open call carries from now on
                self.carrier = next(iter(self.members.values()), None)
                if self.carrier is not None:
                    self.carrier.wake.set()

    def stats(self) -> dict[str, int]:
        return {"messages": self.seq, "outputs": self.outputs, "open_calls": len(self.members),
                "cut_calls": self.cut}

    def _take(self) -> bytes:
        msg = MuxMessage(self.seq, self.buffer)
        self.seq += 1
        self.outputs += len(self.buffer)
        self.buffer = []
        return encode_item(msg)
