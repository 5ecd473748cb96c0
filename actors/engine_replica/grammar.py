"""`grammar-compiler`: the structured-output compile service in a threaded actor.

Compiles run on the actor's threads, never on the engine's step loop; the engine sees an
object whose `submit` returns a concurrent Future, the same shape as the in-process service.
The actor is started by the first `submit`, as vLLM builds its grammar backend on the first
structured request: a copy that never serves structured output never pays for the process
(xgrammar, torch and the vocabulary's token table); the first structured request of a copy
waits for the start as it waits for its compile, holding up no other.

A lost compiler (its process killed, its node gone) is restarted by Ray, and the compiles it
had not answered are sent to the new one (a compile is a pure function of its spec). A spec
that keeps killing it fails its request after COMPILE_RETRIES attempts instead of looping;
the request ends with "grammar compilation failed" and the engine goes on.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import ray

from cluster.sampling_params import StructuredOutputsParams

COMPILE_RETRIES = 3  # attempts of one compile on a restarted compiler


@ray.remote
class GrammarCompilerActor:
    def __init__(self, config, threads: int = 4) -> None:
        from cluster.structured_output import GrammarCompileService
        from cluster.structured_output.compiler import pin_mmap_threshold

        pin_mmap_threshold()  # this process only compiles: see the function
        self.service = GrammarCompileService.for_model(config, max_threads=threads)

    def compile(self, spec: bytes) -> str:
        """Serialized CompiledGrammar for a msgpack-encoded StructuredOutputsParams; runs on
        one of the actor's threads (a bad spec raises ValueError to the caller's future)."""
        # No module-level Decoder: Ray pickles actor classes by value, globals included.
        return self.service.compile(msgspec.msgpack.decode(spec, type=StructuredOutputsParams))


class RayGrammarCompiler:
    """EngineCore's grammar_compiler: `submit(params) -> Future[str]` backed by the actor that
    `start()` returns, called once, on the first submit (from whichever thread submits)."""

    def __init__(self, start: Callable[[], "ray.actor.ActorHandle"]) -> None:
        self._start, self._actor, self._lock = start, None, threading.Lock()

    def submit(self, params: StructuredOutputsParams) -> Future:
        with self._lock:
            if self._actor is None:  # actor creation is asynchronous: this returns at once
                self._actor = self._start()
        return self._actor.compile.remote(msgspec.msgpack.encode(params)).future()


def start_grammar_actor(config, namespace: str | None = None, max_concurrency: int = 4, **options):
    """A named threaded actor; `options` are Ray actor options (scheduling strategy, cpus)."""
    return GrammarCompilerActor.options(name="grammar-compiler", namespace=namespace,
                                        max_concurrency=max_concurrency, num_cpus=0,
                                        max_restarts=-1, max_task_retries=COMPILE_RETRIES,
                                        **options).remote(config, max_concurrency)
