"""`engine`: the scheduler actor. One Serve replica per model copy.

It hosts a `cluster.engine.EngineCore`, creates its TP workers and the grammar compiler inside
the replica's placement group (bundle 0 is the replica itself, bundle 1 + r is rank r; with
`distributed_executor_backend: uni` the one rank runs on a thread of this process), warms
the core up, and drives `core.step_async()` from an asyncio task. What is here is asyncio,
per-request streams and Ray: requests are added and aborted only between steps (the core is
not re-entrant), and each step's outputs are routed to their streams. Every `generate` call
names its ingress: the call yields the request's first outputs as its own item, and after that
an ingress's requests share one message per step (actors/channel/mux.py; the protocol is in
actors/channel/protocol.py).

For the routers (actors/fleet/router.py) the replica publishes, through Serve's periodic
`record_routing_stats`, whether it can serve and a summary of its prefix cache. Once its loop
has failed it refuses every request at once (EngineUnavailableError naming the replica), so
the ingress retries elsewhere while Serve's health check gets it replaced.

A copy fails on its own, without waiting for Serve's health checks (3 misses, each up to 30 s,
then a graceful stop that would wait for requests that cannot finish), when a step raises, when
a step outlasts `step_timeout_s` (a hung collective), or when a worker stops answering its
liveness ping (frozen, dead, its node gone): the replica pings its workers every
`LIVENESS_PERIOD_S` and they answer during steps too, so a long step is never mistaken for a
frozen worker. Failing ends every stream at once: a request with no token yet is retried on
another copy by the ingress, one with tokens gets an error.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from dataclasses import dataclass
from typing import AsyncIterator

import msgspec
import ray
from ray import serve

from actors.engine_replica.executor import RayExecutor, default_torch_threads
from actors.engine_replica.grammar import RayGrammarCompiler, start_grammar_actor
from actors.channel.mux import Member, OutputMux
from actors.channel.protocol import ROUTING_STATS_KEY, EngineUnavailableError, FirstItem, encode_item, request_of
from actors.metrics import EngineMetrics
from cluster.errors import EngineInternalError, EngineOverloadedError
from cluster.messages import EngineOutput, EngineRequest, encode

logger = logging.getLogger("ray.serve")
METRICS_PERIOD_S = 0.5
# Routing keys a replica publishes at most (8 bytes each, sent every routing stats period):
# the blocks it keeps longest, so a cap drops what it would evict first.
ROUTING_SUMMARY_MAX_BLOCKS = 32768
LIVENESS_PERIOD_S = 2.0  # how often the replica pings its workers
LIVENESS_TIMEOUT_S = 10.0  # a worker silent this long (it answers during steps) is frozen or gone


@dataclass
class EngineOptions:
    """How the replica places its actors; from the app builder's args."""

    worker_num_cpus: float = 0.5
    torch_threads: int | None = None
    grammar_threads: int = 4
    worker_env: dict[str, str] | None = None  # extra environment for the worker processes
    record_metrics: bool = True  # the engine's Prometheus series (Ray Serve LLM's log_engine_metrics)
    step_timeout_s: float | None = None  # a longer step means a stuck engine (StepTimeoutError)


@dataclass
class _Stream:
    queue: asyncio.Queue  # outputs (or the loop's failure) until the call's first item
    unfinished: int  # completions (of n) the engine has not finished yet
    mux: OutputMux | None = None  # set with the first item: later outputs go there
    member: Member | None = None


@serve.deployment(name="engine")
class EngineDeployment:
    def __init__(self, config, options: EngineOptions | None = None) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from cluster.engine.engine_core import EngineCore
        from cluster.worker.worker import InProcessExecutor

        options = options or EngineOptions()
        pg = ray.util.get_current_placement_group()
        replica = serve.get_replica_context().replica_id.unique_id
        # Per-replica namespace: every copy names its actors worker-<rank> / grammar-compiler.
        namespace = self.namespace = f"engine-{replica}"
        grammar_opts = {} if pg is None else {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=0)}
        grammar = RayGrammarCompiler(functools.partial(start_grammar_actor, config, namespace,
                                                       options.grammar_threads, **grammar_opts))
        if config.parallel_config.distributed_executor_backend == "uni":  # the one rank in this process
            executor = InProcessExecutor(config, own_thread=True,
                                         torch_threads=options.torch_threads or default_torch_threads(1))
        else:
            executor = RayExecutor(config, pg=pg, first_bundle=1, namespace=namespace,
                                   worker_num_cpus=options.worker_num_cpus,
                                   torch_threads=options.torch_threads, env=options.worker_env)
        core = EngineCore(config, executor, grammar)
        core.warm_up()
        metrics = EngineMetrics(config.model_config.name, replica) if options.record_metrics else None
        self.attach(config, core, executor, metrics, replica, options.step_timeout_s)

    def attach(self, config, core, executor, metrics, replica: str | None = None,
               step_timeout_s: float | None = None) -> None:
        """The loop's state around a core and an executor (tests attach fakes here); `metrics`
        None records no Prometheus series."""
        self.config, self.core, self.executor, self.metrics = config, core, executor, metrics
        self.replica, self.step_timeout_s = replica, step_timeout_s
        self.streams: dict[str, _Stream] = {}
        self.pending_adds: list[tuple[EngineRequest, asyncio.Future]] = []
        self.pending_aborts: list[str] = []
        self.failure: BaseException | None = None
        self.failed = asyncio.Event()  # set with `failure`
        self.loop_task: asyncio.Task | None = None
        self.watch_task: asyncio.Task | None = None
        self.liveness_period_s, self.liveness_timeout_s = LIVENESS_PERIOD_S, LIVENESS_TIMEOUT_S
        self.wake: asyncio.Event | None = None
        self.last_metrics = 0.0
        self.muxes: dict[str, OutputMux] = {}  # by ingress id; kept so `seq` never restarts
        self.steps = 0

    # ---- requests -----------------------------------------------------------------------
    async def generate(self, request: bytes, *, ingress: str, avoid_replicas: tuple[str, ...] = (),
                       **routing) -> AsyncIterator[bytes]:
        """Stream the outputs of one msgpack-encoded EngineRequest to the ingress replica
        `ingress`: a FirstItem with the request's first outputs, then MuxMessages shared with
        that ingress's other calls (actors/channel/mux.py); the call ends when the request is
        done. `avoid_replicas` (and any other routing keyword) is for the router
        (actors/fleet/router.py), which reads it before the call gets here."""
        req = request_of(request)
        self._ensure_loop()
        if self.failure is not None:
            raise self._unavailable()
        if req.lora_request is not None:  # read its folder off the step loop (once per adapter)
            await asyncio.to_thread(self.core.prepare_lora, req.lora_request)
        added = asyncio.get_running_loop().create_future()
        self.pending_adds.append((req, added))
        self.wake.set()
        done = False
        try:
            stream = await added  # the core's ValueError / EngineOverloadedError: nothing queued
            first = await _drain(stream.queue)
            done = sum(o.finished for o in first) >= req.sampling_params.n
            if not done:  # from here on (no await since the drain) outputs go to the mux
                stream.mux = self.muxes.setdefault(ingress, OutputMux())
                stream.member = Member(req.request_id)
            yield encode_item(FirstItem(first, self.replica or "", not done))
            if not done:
                async for item in stream.mux.serve(stream.member):
                    yield item
                done = True
        finally:
            # The consumer went away (disconnect, stop string) after the request was queued.
            queued = added.done() and not added.cancelled() and added.exception() is None
            if queued and not done:
                self.abort_later(req.request_id)

    async def abort(self, request_id: str, **routing) -> None:
        """Abort a request this replica holds (unknown ids are ignored). The ingress pins the
        call to the replica serving the request (`pin_replica`, read by actors/fleet/router.py)."""
        self.abort_later(request_id)

    def abort_later(self, request_id: str) -> None:
        self.pending_aborts.append(request_id)
        if self.wake is not None:
            self.wake.set()

    async def stats(self) -> dict:
        """The core's EngineStats plus this replica's id, node, streams and actor namespace."""
        return {**msgspec.structs.asdict(self.core.stats()), "num_streams": len(self.streams),
                "steps": self.steps, "muxes": {i: m.stats() for i, m in self.muxes.items()},
                "actor_namespace": self.namespace, "replica": self.replica,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def record_routing_stats(self) -> dict:
        """Serve calls this every `request_routing_stats_period_s` and hands the result to the
        routers: whether this replica serves, and what its prefix cache holds."""
        summary = self.core.prefix_cache_summary(ROUTING_SUMMARY_MAX_BLOCKS)
        return {"healthy": self.failure is None, ROUTING_STATS_KEY: encode(summary)}

    async def check_health(self) -> None:
        """Serve calls this periodically; raising makes it replace the replica. A check waiting
        on a silent worker's ping raises as soon as the copy fails (its step timed out, its
        liveness ping went unanswered), not when that ping times out: Serve replaces a copy
        only after several failed checks in a row."""
        if self.failure is None:
            ping = asyncio.ensure_future(self.executor.check_health())
            failed = asyncio.ensure_future(self.failed.wait())
            try:
                await asyncio.wait((ping, failed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                failed.cancel()
                if not ping.done():
                    ping.cancel()
                elif not ping.cancelled() and self.failure is not None:
                    ping.exception()  # retrieved: the copy's failure is what is reported
            if self.failure is None:
                ping.result()  # a dead worker, or one silent past the ping's timeout, raises
        if self.failure is not None:
            raise self._unavailable()

    async def health(self) -> bool:
        await self.check_health()
        return True

    # ---- the step loop ------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self.loop_task is None:
            self.wake = asyncio.Event()
            loop = asyncio.get_running_loop()
            self.loop_task = loop.create_task(self._run())
            self.watch_task = loop.create_task(self._watch_workers())

    async def _run(self) -> None:
        try:
            while True:
                self._apply_pending()
                idle = not self.core.has_unfinished()
                self._record_metrics(force=idle)
                if idle:
                    self.wake.clear()
                    await self.wake.wait()
                    continue
                self._dispatch(await self._step())
        except Exception as exc:  # a dead worker or an engine bug: fail everything, go unhealthy
            logger.exception("engine step loop failed")
            self._fail(exc)

    async def _watch_workers(self) -> None:
        """Ping the workers until the copy fails; one that does not answer fails it (and stops
        the step waiting for it), whatever the step is doing."""
        while self.failure is None:
            await asyncio.sleep(self.liveness_period_s)
            try:
                await asyncio.wait_for(self.executor.check_health(), self.liveness_timeout_s)
            except Exception as exc:
                if self.failure is None:
                    logger.error("engine replica %s: a worker stopped answering: %s", self.replica, _describe(exc))
                    self._fail(WorkerUnresponsiveError(
                        f"a worker did not answer its liveness ping within {self.liveness_timeout_s:g} s "
                        f"({_describe(exc)})"))
                    self.loop_task.cancel()
                return

    def _fail(self, exc: BaseException) -> None:
        """The copy cannot go on: every stream and waiting call gets the error; new work is refused."""
        self.failure = exc
        self.failed.set()
        # A dead, stuck or silent worker is an outage (503, retried elsewhere); anything else is a bug (500).
        outage = (ray.exceptions.RayActorError, StepTimeoutError, WorkerUnresponsiveError)
        err = (self._unavailable() if isinstance(exc, outage)
               else EngineInternalError(f"engine step failed: {_describe(exc)}"))
        for stream in self.streams.values():
            stream.queue.put_nowait(err)
        for mux in self.muxes.values():
            mux.fail(err)
        for _, fut in self.pending_adds:
            if not fut.done():
                fut.set_exception(err)

    async def _step(self) -> list:
        """One core step, bounded by `step_timeout_s`: a worker that hangs (or a collective that
        never completes) would otherwise hold every request of this copy forever."""
        timeout = self.step_timeout_s
        if timeout is None:
            return await self.core.step_async()
        try:
            return await asyncio.wait_for(self.core.step_async(), timeout)
        except asyncio.TimeoutError:
            raise StepTimeoutError(f"a step took longer than step_timeout_s={timeout:g} s") from None

    def _apply_pending(self) -> None:
        adds, self.pending_adds = self.pending_adds, []
        for req, fut in adds:
            if fut.done():  # the caller went away before we got to it
                continue
            try:
                self.core.add_request(req)
            except (ValueError, EngineOverloadedError) as exc:
                fut.set_exception(exc)
                continue
            stream = self.streams[req.request_id] = _Stream(asyncio.Queue(), req.sampling_params.n)
            fut.set_result(stream)
        aborts, self.pending_aborts = self.pending_aborts, []
        for rid in aborts:
            self.core.abort(rid)
            stream = self.streams.pop(rid, None)
            if stream is not None and stream.mux is not None:
                stream.mux.end(stream.member)

    def _dispatch(self, outputs: list[EngineOutput]) -> None:
        self.steps += 1
        for out in outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if stream.mux is not None:
                stream.mux.push(out)
            else:
                stream.queue.put_nowait(out)
            stream.unfinished -= out.finished
            if stream.unfinished <= 0:
                del self.streams[out.request_id]  # all n done; the consumer holds the queue
                if stream.mux is not None:
                    stream.mux.end(stream.member)

    def _unavailable(self) -> EngineUnavailableError:
        return EngineUnavailableError(f"engine replica {self.replica} failed: {_describe(self.failure)}",
                                      self.replica)

    def _record_metrics(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.metrics is not None and (force or now - self.last_metrics >= METRICS_PERIOD_S):
            self.last_metrics = now
            self.metrics.record(self.core.stats())


async def _drain(queue: asyncio.Queue) -> list[EngineOutput]:
    """Everything queued once something is (at least one output); raises a queued failure."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    if isinstance(items[-1], BaseException):
        raise items[-1]
    return items


class StepTimeoutError(RuntimeError):
    """A step did not finish within `step_timeout_s`: the copy is stuck and is replaced."""


class WorkerUnresponsiveError(RuntimeError):
    """A worker did not answer its liveness ping: frozen or gone; the copy is replaced."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
