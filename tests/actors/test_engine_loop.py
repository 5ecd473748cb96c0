"""The engine deployment's asyncio step loop around a scripted core (no Ray, no model):
streaming until all n completions finish, rejections, queue limit, abort when the consumer
goes away, and a failing worker failing every stream and the health check. Calls are read as
the ingress reads them: the first item, then the multiplexed messages (OutputDemux), and the
ingress's grouping of tokens per SSE chunk (`stream_interval`, RequestStream.next)."""
import asyncio
import json
from types import SimpleNamespace

import pytest
from ray.exceptions import RayActorError

from actors.channel.demux import OutputDemux
from actors.channel.ingress import IngressChannel
from actors.channel.protocol import EngineUnavailableError, decode_first
from actors.engine_replica.deployment import EngineDeployment
from cluster.errors import EngineInternalError, EngineOverloadedError
from cluster.messages import EngineOutput, EngineRequest, decode, encode
from cluster.sampling_params import SamplingParams


class FakeCore:
    """Each step gives every live completion one token (the step number); completion i of a
    request ends after max_tokens + i * stagger steps. Records aborts; rejects ids in `reject`;
    refuses admission while `waiting` (sequences queued elsewhere) is at `max_waiting`."""

    def __init__(self, executor, max_waiting=None) -> None:
        self.executor, self.max_waiting = executor, max_waiting
        self.children: dict[str, list[int]] = {}  # id -> tokens so far per index
        self.limits: dict[str, int] = {}
        self.waiting: list[str] = []
        self.aborted: list[str] = []
        self.reject: set[str] = set()
        self.step_no = 0
        self.in_step = False
        self.stagger = 0

    def add_request(self, req: EngineRequest) -> None:
        assert not self.in_step, "a request was added while a step was on the workers"
        if req.request_id in self.reject:
            raise ValueError("prompt length 9999 leaves no room for output")
        if self.max_waiting is not None and len(self.waiting) >= self.max_waiting:
            raise EngineOverloadedError(f"the engine's waiting queue is full (max_waiting={self.max_waiting})")
        self.children[req.request_id] = [0] * req.sampling_params.n
        self.limits[req.request_id] = req.sampling_params.max_tokens

    def abort(self, rid: str) -> list[EngineOutput]:
        assert not self.in_step, "a request was aborted while a step was on the workers"
        self.aborted.append(rid)
        self.children.pop(rid, None)
        return []

    def has_unfinished(self) -> bool:
        return bool(self.children)

    async def step_async(self) -> list[EngineOutput]:
        self.step_no += 1
        self.in_step = True
        try:
            result = await self.executor.execute_async(b"plan")
        finally:
            self.in_step = False
        assert result == b"rank0"
        plan = self.step_no
        outs = []
        for rid, counts in list(self.children.items()):
            ends = [self.limits[rid] + i * self.stagger for i in range(len(counts))]
            for i in range(len(counts)):
                if counts[i] >= ends[i]:
                    continue  # this completion already finished
                counts[i] += 1
                done = counts[i] >= ends[i]
                outs.append(EngineOutput(rid, [plan], index=i, finish_reason="length" if done else None))
            if all(c >= e for c, e in zip(counts, ends)):
                del self.children[rid]
        return outs

    def stats(self) -> SimpleNamespace:
        return SimpleNamespace(running=len(self.children))


class FakeExecutor:
    def __init__(self) -> None:
        self.error: Exception | None = None
        self.hang = False  # a stuck worker: the step never returns
        self.frozen = False  # a frozen worker (SIGSTOP): no step returns, no ping is answered

    async def execute_async(self, data: bytes) -> bytes:
        await asyncio.sleep(0.001)
        if self.hang or self.frozen:
            await asyncio.Event().wait()
        if self.error:
            raise self.error
        return b"rank0"

    async def check_health(self) -> None:
        if self.frozen:
            await asyncio.Event().wait()
        if self.error:
            raise self.error


def make_engine(max_waiting=None, step_timeout_s=None):
    cls = EngineDeployment.func_or_class
    eng = cls.__new__(cls)
    config = SimpleNamespace(scheduler_config=SimpleNamespace(max_waiting=max_waiting))
    executor = FakeExecutor()
    eng.attach(config, FakeCore(executor, max_waiting), executor, SimpleNamespace(record=lambda stats: None),
               step_timeout_s=step_timeout_s)
    eng.namespace = "engine-test"
    return eng


def request(rid: str, n: int = 1, max_tokens: int = 3) -> bytes:
    return encode(EngineRequest(rid, [1, 2, 3], SamplingParams(n=n, max_tokens=max_tokens)))


async def collect(eng, data: bytes, demux: OutputDemux | None = None) -> list[EngineOutput]:
    """Every output of one request, read as the ingress reads them: its call's FirstItem, then
    the MuxMessages of its ingress, which the demux sorts back to the request (they may come on
    another call of the same ingress); raises what the call raises."""
    demux = demux or OutputDemux(engine=None)
    req = decode(data, EngineRequest)
    queue = demux.register(req.request_id)
    call = eng.generate(data, ingress=demux.id)
    first = decode_first(await call.__anext__())
    outs = list(first.outputs)
    if first.muxed:
        demux.follow(req.request_id, first.replica, call)
    else:
        await call.aclose()
    while sum(o.finished for o in outs) < req.sampling_params.n:
        item = await asyncio.wait_for(queue.get(), 5)
        if isinstance(item, BaseException):
            raise item
        if item is not OutputDemux.ENDED:
            outs.append(item)
    demux.release(req.request_id)
    return outs


class Handle:
    """The engine deployment's handle as the ingress holds it, around the engine object:
    `options(stream=True).generate.remote(...)` streams its `generate`, `abort.remote` aborts."""

    def __init__(self, eng) -> None:
        self.generate = SimpleNamespace(remote=lambda *args, **kwargs: Call(eng.generate(*args, **kwargs)))
        self.abort = SimpleNamespace(remote=eng.abort)

    def options(self, **_):
        return self


class Call:
    """A Serve streaming call over the engine's async generator."""

    def __init__(self, gen) -> None:
        self.gen = gen

    def __aiter__(self):
        return self

    def __anext__(self):
        return self.gen.__anext__()

    def cancel(self) -> None:
        asyncio.ensure_future(self.gen.aclose())


async def chunk_outputs(eng, data: bytes, stream_interval: int) -> list[list[EngineOutput]]:
    """The ingress's groups of EngineOutputs, one per SSE chunk, for one request: its stream's
    first outputs, then each `RequestStream.next(stream_interval)` until every completion finished."""
    channel = IngressChannel(Handle(eng), SimpleNamespace(retry=lambda: None))
    req = decode(data, EngineRequest)
    (stream,) = await channel.open([req])
    items = [stream.first]
    while sum(o.finished for item in items for o in item) < req.sampling_params.n:
        items.append(await asyncio.wait_for(stream.next(stream_interval), 5))
    stream.close()
    return items


def test_streams_every_completion_until_all_n_finish():
    async def main():
        eng = make_engine()
        demux = OutputDemux(engine=None)  # one ingress: a's outputs may come on b's call
        a, b = await asyncio.gather(collect(eng, request("a", n=2, max_tokens=3), demux),
                                    collect(eng, request("b", max_tokens=5), demux))
        return eng, a, b

    eng, a, b = asyncio.run(main())
    for index in (0, 1):
        mine = [o for o in a if o.index == index]
        assert len(mine) == 3 and [o.finish_reason for o in mine] == [None, None, "length"]
    assert [o.request_id for o in b] == ["b"] * 5 and b[-1].finished
    assert eng.core.aborted == [] and eng.streams == {}


def test_stream_interval_sends_first_token_at_once_then_groups():
    async def main():
        eng = make_engine()
        items = await chunk_outputs(eng, request("s", max_tokens=8), stream_interval=3)
        return eng, items

    eng, items = asyncio.run(main())
    # One token per step: the first alone, then every 3, and whatever is left at the finish.
    assert [sum(len(o.new_token_ids) for o in item) for item in items] == [1, 3, 3, 1]
    assert [t for item in items for o in item for t in o.new_token_ids] == list(range(1, 9))
    assert items[-1][-1].finished and eng.streams == {}


def test_stream_interval_keeps_streaming_after_one_of_n_finishes():
    async def main():
        eng = make_engine()
        eng.core.stagger = 2  # completion 0 ends after 2 tokens, completion 1 after 4
        items = await chunk_outputs(eng, request("n2", n=2, max_tokens=2), stream_interval=3)
        return eng, [o for item in items for o in item]

    eng, outs = asyncio.run(main())
    for index, length in ((0, 2), (1, 4)):
        mine = [o for o in outs if o.index == index]
        assert [t for o in mine for t in o.new_token_ids] == list(range(1, length + 1))
        assert mine[-1].finish_reason == "length"
    assert eng.core.aborted == [] and eng.streams == {}


def test_rejected_request_raises_and_queues_nothing():
    async def main():
        eng = make_engine()
        eng.core.reject.add("bad")
        with pytest.raises(ValueError, match="no room"):
            await collect(eng, request("bad"))
        return eng, await collect(eng, request("good", max_tokens=1))

    eng, good = asyncio.run(main())
    assert "bad" not in eng.core.children and good[-1].finished and eng.streams == {}


def test_queue_limit_is_overloaded():
    async def main():
        eng = make_engine(max_waiting=2)
        eng.core.waiting = ["x", "y"]
        with pytest.raises(EngineOverloadedError, match="max_waiting=2"):
            await collect(eng, request("c"))
        eng.core.waiting = ["x"]
        return await collect(eng, request("d", max_tokens=2))

    assert asyncio.run(main())[-1].finished


def test_consumer_leaving_aborts_between_steps():
    async def main():
        eng = make_engine()
        gen = eng.generate(request("long", max_tokens=10_000), ingress="i1")
        first = decode_first(await gen.__anext__()).outputs
        await gen.aclose()  # what a cancelled Serve stream does to the generator
        for _ in range(50):
            await asyncio.sleep(0.002)
        return eng, first

    eng, first = asyncio.run(main())
    assert first[0].request_id == "long" and not first[0].finished
    assert eng.core.aborted == ["long"] and eng.streams == {} and not eng.core.has_unfinished()


def test_failed_step_fails_streams_and_health():
    async def main():
        eng = make_engine()
        gen = eng.generate(request("r", max_tokens=10_000), ingress="i1")
        await gen.__anext__()
        eng.executor.error = RayActorError(error_msg="worker-1 died")
        with pytest.raises(EngineUnavailableError, match="worker-1 died"):
            async for _ in gen:
                pass
        with pytest.raises(EngineUnavailableError):
            await eng.check_health()
        with pytest.raises(EngineUnavailableError):
            await collect(eng, request("after"))

    asyncio.run(main())


def test_stuck_step_fails_the_copy_as_unavailable():
    """A step past step_timeout_s (a hung worker) is an outage, not a bug: in-flight streams
    get EngineUnavailableError (503; retried elsewhere before a first token), the replica fails
    its health check (Serve replaces it) and refuses new work."""
    async def main():
        eng = make_engine(step_timeout_s=0.2)
        gen = eng.generate(request("r", max_tokens=10_000), ingress="i1")
        await gen.__anext__()
        eng.executor.hang = True
        with pytest.raises(EngineUnavailableError, match="step_timeout_s=0.2"):
            async for _ in gen:
                pass
        with pytest.raises(EngineUnavailableError):
            await eng.check_health()
        with pytest.raises(EngineUnavailableError):
            await collect(eng, request("after"))

    asyncio.run(main())


def test_a_frozen_worker_fails_the_copy_without_a_step_timeout():
    """No step_timeout_s: a worker that answers neither its step nor its liveness ping fails the
    copy after the liveness timeout. The stream in flight, a request waiting to be added, and
    later requests all get EngineUnavailableError (503, retried before a first token), never a
    wait for Serve's health checks; a worker that is only busy (a long step) keeps answering
    its ping and fails nothing."""
    async def main():
        eng = make_engine()
        eng.liveness_period_s, eng.liveness_timeout_s = 0.05, 0.3
        gen = eng.generate(request("r", max_tokens=10_000), ingress="i1")
        await gen.__anext__()
        eng.executor.hang = True  # busy: a long step, pings still answered
        await asyncio.sleep(1.0)
        assert eng.failure is None
        eng.executor.frozen = True
        waiting = asyncio.ensure_future(collect(eng, request("queued")))
        started = asyncio.get_running_loop().time()
        with pytest.raises(EngineUnavailableError, match="did not answer its liveness ping within 0.3 s"):
            async for _ in gen:
                pass
        assert asyncio.get_running_loop().time() - started < 2.0
        with pytest.raises(EngineUnavailableError):
            await waiting
        with pytest.raises(EngineUnavailableError):
            await eng.check_health()
        with pytest.raises(EngineUnavailableError):
            await collect(eng, request("after"))

    asyncio.run(main())


def test_a_health_check_waiting_on_a_frozen_worker_fails_with_the_copy():
    """Serve's health check pings the workers; on a frozen one the ping waits for its timeout.
    Once the copy fails (here its liveness ping, sooner), a check already waiting fails too."""
    async def main():
        eng = make_engine()
        eng.liveness_period_s, eng.liveness_timeout_s = 0.05, 0.3
        gen = eng.generate(request("r", max_tokens=10_000), ingress="i1")
        await gen.__anext__()
        eng.executor.frozen = True
        check = asyncio.ensure_future(eng.check_health())  # its ping is never answered
        with pytest.raises(EngineUnavailableError, match="liveness ping"):
            async for _ in gen:
                pass
        with pytest.raises(EngineUnavailableError, match="liveness ping"):
            await asyncio.wait_for(check, 1.0)

    asyncio.run(main())


def test_engine_bug_in_a_step_is_internal_for_inflight_and_unavailable_after():
    """A ValueError raised inside a step (an engine bug, a broken processor) is not the
    client's mistake: the in-flight stream gets EngineInternalError (HTTP 500), never the
    ValueError (HTTP 400); the replica then refuses work and fails its health check."""
    async def main():
        eng = make_engine()
        gen = eng.generate(request("r", max_tokens=10_000), ingress="i1")
        await gen.__anext__()
        eng.executor.error = ValueError("row 3 has no state")
        with pytest.raises(EngineInternalError, match="row 3 has no state") as caught:
            async for _ in gen:
                pass
        assert not isinstance(caught.value, ValueError)
        with pytest.raises(EngineUnavailableError):
            await eng.check_health()
        with pytest.raises(EngineUnavailableError):
            await collect(eng, request("after"))

    asyncio.run(main())


# ---- multiplexed calls (an ingress id): one message per step for all of an ingress's requests
async def drain_call(gen) -> list[bytes]:
    return [x async for x in gen]


def split_items(items: list[bytes]):
    from actors.channel.protocol import decode_first, decode_mux

    return decode_first(items[0]), [decode_mux(x) for x in items[1:]]


def test_muxed_calls_share_one_message_per_step_and_hand_the_carrier_over():
    async def main():
        eng = make_engine()
        calls = [eng.generate(request("a", max_tokens=2), ingress="i1"),
                 eng.generate(request("b", n=2, max_tokens=6), ingress="i1")]
        return eng, await asyncio.gather(*[drain_call(c) for c in calls])

    eng, (a_items, b_items) = asyncio.run(main())
    (a_first, a_msgs), (b_first, b_msgs) = split_items(a_items), split_items(b_items)
    assert a_first.muxed and b_first.muxed and a_first.replica == b_first.replica
    msgs = sorted(a_msgs + b_msgs, key=lambda m: m.seq)
    assert [m.seq for m in msgs] == list(range(len(msgs))) and len(msgs) <= eng.steps
    # Every token of every completion arrives once, in order, over the first items and the messages.
    outs = a_first.outputs + b_first.outputs + [o for m in msgs for o in m.outputs]
    for rid, index, length in (("a", 0, 2), ("b", 0, 6), ("b", 1, 6)):
        mine = [o for o in outs if (o.request_id, o.index) == (rid, index)]
        assert [t for o in mine for t in o.new_token_ids] == list(range(1, length + 1))
        assert [o.finished for o in mine][-1] and not any(o.finished for o in mine[:-1])
    # One message carried both requests' tokens; b's call carried on after a's ended.
    assert any({o.request_id for o in m.outputs} == {"a", "b"} for m in msgs)
    assert b_msgs and all(o.request_id == "b" for o in b_msgs[-1].outputs)
    assert eng.muxes["i1"].stats() == {"messages": len(msgs), "outputs": len(outs) - 3, "open_calls": 0,
                                          "cut_calls": 0}
    assert eng.streams == {} and eng.core.aborted == []


def test_a_muxed_request_aborted_by_id_ends_its_call():
    async def main():
        eng = make_engine()
        gen = eng.generate(request("long", max_tokens=10_000), ingress="i1")
        first = await gen.__anext__()
        await eng.abort("long", pin_replica="r")
        rest = await asyncio.wait_for(drain_call(gen), 5)
        return eng, first, rest

    eng, first, rest = asyncio.run(main())
    assert split_items([first] + rest)[0].muxed
    assert eng.core.aborted == ["long"] and eng.streams == {} and eng.muxes["i1"].members == {}


def test_a_failed_step_fails_every_muxed_call():
    async def main():
        eng = make_engine()
        gens = [eng.generate(request(r, max_tokens=10_000), ingress="i1") for r in ("x", "y")]
        for g in gens:
            await g.__anext__()
        eng.executor.error = RayActorError(error_msg="worker-0 died")
        for g in gens:
            with pytest.raises(EngineUnavailableError, match="worker-0 died"):
                await asyncio.wait_for(drain_call(g), 5)

    asyncio.run(main())


class TwoCopies:
    """The engine deployment's handle over two copies: a call goes to the first copy not in its
    `avoid_replicas`; an abort to the copy it is pinned to."""

    def __init__(self, *engines) -> None:
        self.engines = engines
        self.generate = SimpleNamespace(remote=self._generate)
        self.abort = SimpleNamespace(remote=lambda rid, pin_replica=None, **_: self._by_id(pin_replica).abort(rid))

    def options(self, **_):
        return self

    def _generate(self, data, avoid_replicas=(), **kwargs):
        eng = next(e for e in self.engines if e.replica not in avoid_replicas)
        return Call(eng.generate(data, **kwargs))

    def _by_id(self, replica):
        return next(e for e in self.engines if e.replica == replica)


def test_a_whole_answer_whose_copy_fails_mid_answer_is_sent_again_and_answers_in_full(smollm2_path):
    """The client of a non-streamed answer has seen nothing: when its copy fails after the first
    tokens, the ingress sends the request again, whole, under `<id>~retry1` to the other copy, and
    the answer is that copy's, every token of it (the resend once waited out its grace and 500ed:
    the outputs under the new id were never read)."""
    from actors.http.openai_format import CompletionFormat
    from actors.http.prompt import PromptState
    from actors.http.streams import EngineStreams
    from cluster.tokenizer import load_tokenizer

    async def main():
        a, b = make_engine(), make_engine()
        a.replica, b.replica = "a", "b"
        retries = []
        metrics = SimpleNamespace(retry=lambda: retries.append(1), first_token=lambda *_: None,
                                  inter_token=lambda *_: None, finish=lambda *_: None)
        streams = EngineStreams(TwoCopies(a, b), load_tokenizer(smollm2_path), metrics)
        p = PromptState("whole", None, [1, 2, 3], SamplingParams(max_tokens=20))
        await streams.start([p])
        assert p.stream.replica == "a"
        a.executor.error = RayActorError(error_msg="worker-0 died")  # a's next step fails
        answer = await asyncio.wait_for(streams.collect([p], CompletionFormat(streams.tokenizer, "m", "cmpl-1", False)), 10)
        return answer, p, retries, b

    answer, p, retries, b = asyncio.run(main())
    body = json.loads(answer.body)
    assert answer.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
    assert len(p.final.outputs[0].token_ids) == 20 and p.stream.request_id == "whole~retry1"
    assert retries == [1] and b.streams == {} and not b.core.has_unfinished()
