"""`grammar-compiler`: the structured-output compile service in a threaded actor.

Compiles run on the actor's threads, never on the engine's step loop; the engine sees an
object whose `submit` returns a concurrent Future, the same shape as the in-process service.
"""
from __future__ import annotations

from concurrent.futures import Future

import msgspec
import ray

from cluster.sampling_params import StructuredOutputsParams


@ray.remote
class GrammarCompilerActor:
    def __init__(self, config, threads: int = 4) -> None:
        from cluster.structured_output import GrammarCompileService

        self.service = GrammarCompileService.for_model(config, max_threads=threads)

    def compile(self, spec: bytes) -> str:
        """Serialized CompiledGrammar for a msgpack-encoded StructuredOutputsParams; runs on
        one of the actor's threads (a bad spec raises ValueError to the caller's future)."""
        # No module-level Decoder: Ray pickles actor classes by value, globals included.
        return self.service.compile(msgspec.msgpack.decode(spec, type=StructuredOutputsParams))


class RayGrammarCompiler:
    """EngineCore's grammar_compiler: `submit(params) -> Future[str]` backed by the actor."""

    def __init__(self, actor) -> None:
        self.actor = actor

    def submit(self, params: StructuredOutputsParams) -> Future:
        return self.actor.compile.remote(msgspec.msgpack.encode(params)).future()


def start_grammar_actor(config, namespace: str | None = None, max_concurrency: int = 4, **options):
    """A named threaded actor; `options` are Ray actor options (scheduling strategy, cpus)."""
    return GrammarCompilerActor.options(name="grammar-compiler", namespace=namespace,
                                        max_concurrency=max_concurrency, num_cpus=0,
                                        **options).remote(config, max_concurrency)
