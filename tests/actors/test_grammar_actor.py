"""The engine copy's handle on its grammar compiler (actors/engine_replica/grammar.py): the actor
is started by the first structured request, once, whichever thread submits it; the compile
requests carry the spec as msgpack. The actor itself, started, killed and restarted on a real
Ray, is tests/actors/test_fleet.py's."""
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from actors.engine_replica.grammar import RayGrammarCompiler
from cluster.sampling_params import StructuredOutputsParams


class _Remote:
    def __init__(self, sent: list) -> None:
        self.sent = sent

    def remote(self, spec: bytes):
        self.sent.append(msgspec.msgpack.decode(spec, type=StructuredOutputsParams))
        done = Future()
        done.set_result(f"grammar {len(self.sent)}")
        return type("Ref", (), {"future": lambda _self: done})()


class _Actor:
    def __init__(self, sent: list) -> None:
        self.compile = _Remote(sent)


def test_the_actor_starts_on_the_first_submit_and_only_once():
    starts, sent, lock = [], [], threading.Lock()
    barrier = threading.Barrier(8)

    def start():
        with lock:
            starts.append(threading.get_ident())
        return _Actor(sent)

    compiler = RayGrammarCompiler(start)
    assert starts == []  # a copy that serves no structured output starts no compiler

    def submit(i: int) -> str:
        barrier.wait()  # every thread submits at once
        return compiler.submit(StructuredOutputsParams(choice=[f"a{i}", f"b{i}"])).result(timeout=10)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(submit, range(8)))
    assert len(starts) == 1
    assert sorted(answers) == sorted(f"grammar {i}" for i in range(1, 9))
    assert sorted(p.choice[0] for p in sent) == sorted(f"a{i}" for i in range(8))
    compiler.submit(StructuredOutputsParams(regex="[0-9]+"))
    assert len(starts) == 1 and sent[-1].regex == "[0-9]+"
