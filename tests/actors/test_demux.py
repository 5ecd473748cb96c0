"""The ingress's side of the multiplexed engine stream (actors/channel/demux.py) around scripted calls
(no Ray): messages of one engine replica delivered in `seq` order whichever call brings them,
to the right request's queue; a call's error reaches its own request; the end of a call is
marked."""
import asyncio

from actors.channel.protocol import MuxMessage, encode_item
from actors.channel.demux import OutputDemux
from cluster.messages import EngineOutput


class Call:
    """A scripted engine call: yields its items (waiting on a gate before each), then raises
    `error` if given."""

    def __init__(self, items, gates, error=None) -> None:
        self.items, self.gates, self.error = items, gates, error

    async def __aiter__(self):
        for item, gate in zip(self.items, self.gates):
            await gate.wait()
            yield encode_item(item)
        if self.error:
            raise self.error


def out(rid: str, token: int, finished: bool = False) -> EngineOutput:
    return EngineOutput(rid, [token], finish_reason="length" if finished else None)


def drain(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_messages_are_delivered_in_seq_order_per_replica():
    async def main():
        demux = OutputDemux(engine=None)
        qa, qb = demux.register("a"), demux.register("b")
        gates = [asyncio.Event() for _ in range(3)]
        # seq 1 comes (on a's call) before seq 0 (on b's call); seq 2 again on a's call.
        demux.follow("a", "r1", Call([MuxMessage(1, [out("a", 2), out("b", 2)]),
                                      MuxMessage(2, [out("a", 3, True)])], [gates[0], gates[2]]))
        demux.follow("b", "r1", Call([MuxMessage(0, [out("a", 1), out("b", 1, True)])], [gates[1]]))
        gates[0].set()
        await asyncio.sleep(0.01)
        early = drain(qa) + drain(qb)
        gates[1].set()
        gates[2].set()
        await asyncio.sleep(0.01)
        return early, drain(qa), drain(qb)

    early, a, b = asyncio.run(main())
    assert early == []  # seq 1 waits for seq 0
    assert [o.new_token_ids[0] for o in a[:-1]] == [1, 2, 3] and a[-1] is OutputDemux.ENDED
    assert [o.new_token_ids[0] for o in b[:-1]] == [1, 2] and b[-1] is OutputDemux.ENDED


def test_a_call_error_reaches_its_request_and_released_requests_are_dropped():
    async def main():
        demux = OutputDemux(engine=None)
        qa, qb = demux.register("a"), demux.register("b")
        demux.release("b")
        go = asyncio.Event()
        go.set()
        demux.follow("a", "r1", Call([MuxMessage(0, [out("a", 1), out("b", 1)])], [go], RuntimeError("gone")))
        await asyncio.sleep(0.01)
        return drain(qa), drain(qb)

    a, b = asyncio.run(main())
    assert a[0].new_token_ids == [1] and isinstance(a[1], RuntimeError) and b == []
