"""The ingress's failover (actors/channel/failover.py) around a scripted engine handle (no Ray cluster):
which failures are retried, that a retry names the replicas that refused, and the count."""
import asyncio
import pickle

import pytest
from ray.exceptions import ActorUnavailableError, RayTaskError
from ray.serve import context as serve_context

from actors.channel.protocol import EngineUnavailableError
from actors.channel.failover import Failover, refused_by
from cluster.errors import EngineInternalError, EngineOverloadedError


class FakeStream:
    def __init__(self, outcome) -> None:
        self.outcome, self.cancelled = outcome, False

    async def __anext__(self):
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome

    def cancel(self) -> None:
        self.cancelled = True


class FakeEngine:
    """`options(stream=True).generate.remote(...)` hands out the scripted outcomes in order."""

    def __init__(self, *outcomes) -> None:
        self.outcomes, self.calls, self.streams = list(outcomes), [], []
        self.generate = self

    def options(self, stream: bool):
        assert stream
        return self

    def remote(self, request: bytes, avoid_replicas: tuple = ()):
        self.calls.append((request, avoid_replicas))
        self.streams.append(FakeStream(self.outcomes.pop(0)))
        return self.streams[-1]


class Counter:
    def __init__(self) -> None:
        self.retries = 0

    def retry(self) -> None:
        self.retries += 1


def _open(engine, **kw):
    metrics = Counter()
    result = asyncio.run(Failover(engine, metrics, backoff_s=0.0, **kw).open(b"req"))
    return result, metrics.retries


def _wrapped(exc: BaseException) -> BaseException:
    """What a Serve handle raises for an exception in the replica: RayTaskError(cause)."""
    return RayTaskError("generate", "remote traceback", exc).as_instanceof_cause()


def test_a_refusal_before_the_first_token_is_retried_avoiding_that_replica():
    engine = FakeEngine(_wrapped(EngineUnavailableError("engine replica a failed", "a")),
                        ActorUnavailableError("b is unreachable", None), b"first tokens")
    (stream, first), retries = _open(engine)
    assert first == b"first tokens" and stream is engine.streams[-1]
    assert [avoid for _, avoid in engine.calls] == [(), ("a",), ("a",)]
    assert retries == 2 and engine.streams[0].cancelled and engine.streams[1].cancelled


@pytest.mark.parametrize("error", [ValueError("prompt too long"), EngineOverloadedError("queue full"),
                                   EngineInternalError("a bug in a step")])
def test_bad_input_a_full_queue_and_engine_bugs_are_not_retried(error):
    engine = FakeEngine(_wrapped(error), b"never")
    with pytest.raises(type(error)):
        _open(engine)
    assert len(engine.calls) == 1


def test_gives_up_after_max_attempts_with_the_last_error():
    engine = FakeEngine(*[_wrapped(EngineUnavailableError(f"replica {r} failed", r)) for r in "abc"])
    with pytest.raises(EngineUnavailableError) as raised:
        _open(engine, max_attempts=3)
    assert refused_by(raised.value) == "c"
    assert [avoid for _, avoid in engine.calls] == [(), ("a",), ("a", "b")]


def test_the_refusing_replica_survives_pickling_and_wrapping():
    err = pickle.loads(pickle.dumps(EngineUnavailableError("engine replica r1 failed", "r1")))
    assert (str(err), err.replica) == ("engine replica r1 failed", "r1")
    assert refused_by(_wrapped(err)) == "r1"
    assert refused_by(ActorUnavailableError("gone", None)) is None


class Waiting(FakeStream):
    """A stream whose first item never comes."""

    async def __anext__(self):
        await asyncio.Event().wait()


class ContextEngine(FakeEngine):
    """Records the Serve request context each call is made in; its streams never start."""

    def __init__(self) -> None:
        super().__init__()
        self.contexts = []

    def remote(self, request: bytes, avoid_replicas: tuple = ()):
        self.contexts.append(serve_context._get_serve_request_context()._internal_request_id)
        self.streams.append(Waiting(None))
        return self.streams[-1]


def test_calls_are_not_children_of_the_serve_request_and_are_cancelled_before_the_first_item():
    """Serve cancels the calls a cancelled request made, found by the request context's internal
    id; after its first item an engine call carries other requests' outputs, so it is made outside
    that context (`outside_the_request`). Before the first item the ingress cancels it itself."""
    engine = ContextEngine()

    async def run():
        serve_context._serve_request_context.set(serve_context._RequestContext(_internal_request_id="http-1"))
        task = asyncio.create_task(Failover(engine, Counter()).open(b"req"))
        await asyncio.sleep(0.05)
        assert engine.contexts == [""]  # not "http-1": Serve would cancel it with the HTTP request
        assert serve_context._get_serve_request_context()._internal_request_id == "http-1"
        task.cancel()  # what Serve does to the handler when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(run())
    assert engine.streams[0].cancelled
