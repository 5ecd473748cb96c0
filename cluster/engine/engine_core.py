"""The engine in one object: admission, add / abort, and the step.

`EngineCore` owns every request from admission to finish. Requests arrive validated
(`InputProcessor.process`, run where they enter); the core checks only what it alone knows
(its KV capacity, its queue), fans n > 1 out (cluster/engine/parallel_sampling.py) and hands
the sequences to the scheduler. Each step polls the grammar compiles,
schedules a `StepPlan`, submits it to the executor, applies rank 0's `StepResult` and returns
the step's `EngineOutput` deltas (a failed grammar compile is one of them). The offline `LLM`
drives `step()`, the Ray engine actor `step_async()`: the same shape, the executor awaited.

With `async_scheduling` two steps are in flight: the next one is planned and queued on the
workers before the current one's result is applied, so the workers go from one to the next
while the engine does its bookkeeping (the scheduler's placeholders make that plan right).
The executor must run the plans it is given in submission order.
The core is not re-entrant: add and abort between `step` calls (steps may be in flight then).
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import Future
from typing import Protocol

import msgspec

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.parallel_sampling import ParallelSampling
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler
from cluster.errors import QUEUE_TIMEOUT, REQUEST_TIMEOUT, EngineOverloadedError
from cluster.kv_tier import TierStore
from cluster.lora.adapter import LoRAAdapter, LoRARequest
from cluster.lora.registry import LoRARegistry
from cluster.messages import (EngineOutput, EngineRequest, KVTierCounters, Logprobs, PrefixCacheSummary, StepPlan,
                              StepResult, decode, encode)
from cluster.routing import PrefixCacheReporter
from cluster.sampling_params import SamplingParams, StructuredOutputsParams

# While only requests waiting for their grammar are left, a step waits this long for it.
GRAMMAR_POLL_S = 0.005


class Executor(Protocol):
    num_kv_blocks: int

    def submit(self, plan_bytes: bytes) -> Future:
        """Queue a step on every rank; the future holds rank 0's StepResult bytes (None when
        nothing was sampled) or the first rank's error. Steps run in submission order."""


class GrammarCompiler(Protocol):
    def submit(self, params: StructuredOutputsParams) -> Future: ...


class EngineStats(msgspec.Struct, kw_only=True):
    """One engine's state and counters since it started (metrics, /engine/stats, tests)."""

    running: int  # sequences in the batch
    waiting: int  # sequences queued (n > 1 requests count each completion)
    num_unfinished: int  # requests (not sequences) not finished
    kv_usage: float  # fraction of KV blocks in use
    num_free_blocks: int
    num_blocks: int
    preemptions: int
    prefix_cache_queries: int  # prompt tokens looked up
    prefix_cache_hits: int  # prompt tokens found
    prompt_tokens: int
    generation_tokens: int
    finished: dict[str, int]  # completions by finish reason
    # Speculative decoding (zeros without it): verified drafts (one per request and step),
    # their tokens, the accepted ones, and the tokens emitted per draft (1 + accepted / drafts).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_mean_acceptance_length: float = 0.0
    # LoRA (empty without it): requests admitted per adapter, the adapters in the workers' slots,
    # loads into a slot, and each adapter's last read-and-check time from its folder.
    lora_requests: dict[str, int] = {}
    lora_resident: list[str] = []
    lora_slot_loads: int = 0
    lora_load_seconds: dict[str, float] = {}
    # The KV tier (zeros without it; docs/kv_tier.md): prompt tokens read from it instead of
    # computed, requests whose read failed (computed instead), and rank 0's traffic with it.
    kv_tier_hit_tokens: int = 0
    kv_tier_load_failures: int = 0
    kv_tier_bytes_read: int = 0
    kv_tier_bytes_written: int = 0
    kv_tier_blocks_written: int = 0
    kv_tier_load_seconds: float = 0.0
    kv_tier_evictions: int = 0
    kv_tier_spills: int = 0
    kv_tier_corrupt_files: int = 0
    kv_tier_writes_dropped: int = 0
    kv_tier_promotions: int = 0
    kv_tier_writes_held: int = 0  # blocks not written while the tier held (docs/kv_tier.md)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.config, self.executor, self.grammar_compiler = config, executor, grammar_compiler
        cc = config.cache_config
        self.block_manager = BlockManager(executor.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
        # The KV tier, as the engine sees it: which blocks every rank's files hold.
        self.scheduler = Scheduler(config, self.block_manager, TierStore.from_config(config))
        self.requests = ParallelSampling()
        self.loras = LoRARegistry(config) if config.lora_config.enable_lora else None
        self.reporter = PrefixCacheReporter(self.block_manager)
        self.grammar_futures: dict[str, Future] = {}  # request id -> compile future
        self.num_added = 0  # requests admitted since start (a prefix summary's version moves with it)
        self.in_flight: deque[tuple[StepPlan, Future]] = deque()  # submitted, oldest first
        # (admitted at, request id) in admission order, for the deadlines (`_expire`).
        self.queued_since: deque[tuple[float, str]] = deque()
        self.running_since: deque[tuple[float, str]] = deque()
        self.depth = 2 if config.scheduler_config.async_scheduling else 1
        self.kv_tier = KVTierCounters()  # rank 0's KV tier counters, as its last result reported them
        self.reset_stats()

    def reset_stats(self) -> None:
        self.prompt_tokens = self.generation_tokens = 0
        # Rank 0's KV tier counters (cumulative on the worker): the last report, and the one at
        # the last reset, subtracted.
        self.kv_tier_base = self.kv_tier
        self.finished: dict[str, int] = {}  # completions by finish reason
        self.lora_requests: dict[str, int] = {}  # requests admitted per adapter

    def prepare_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Read and check the adapter a request names (LoRANotFoundError: no such adapter;
        LoRAAdapterError: one that cannot be served). Thread-safe: an engine on an event loop
        runs it in a thread before `add_request`, so the step loop never waits for a disk."""
        if self.loras is None:
            raise ValueError(f"LoRA adapter {lora_request.lora_name!r} asked for, but this engine serves "
                             "no adapters (enable_lora is off)")
        return self.loras.prepare(lora_request)

    # ---- entry ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Admit and queue a request that `InputProcessor.process` validated. ValueError (a
        duplicate id, a prompt larger than the KV cache, no grammar compiler for a grammar, a LoRA
        adapter that is unknown or cannot be served) or EngineOverloadedError (the waiting queue is
        full) leave the engine as it was (an adapter read for it stays known)."""
        rid, params = request.request_id, request.sampling_params
        if rid in self.requests:
            raise ValueError(f"request_id {rid!r} is already running")
        if params.structured_outputs is not None and self.grammar_compiler is None:
            raise ValueError("structured_outputs needs a grammar compiler; none is configured")
        max_tokens = self._max_tokens(len(request.prompt_token_ids), params.max_tokens)
        lora = None if request.lora_request is None else self.prepare_lora(request.lora_request)
        self._admit(params.n)
        self._queue(request, max_tokens, lora)

    def _queue(self, request: EngineRequest, max_tokens: int, lora: LoRAAdapter | None = None) -> None:
        rid, params = request.request_id, request.sampling_params
        seqs = self.requests.fan_out(request, max_tokens, lora)
        if lora is not None:
            self.lora_requests[lora.name] = self.lora_requests.get(lora.name, 0) + 1
        if params.structured_outputs is not None:
            self.grammar_futures[rid] = self.grammar_compiler.submit(params.structured_outputs)
        self.num_added += 1
        sc, now = self.config.scheduler_config, time.monotonic()
        if sc.max_queue_wait_s is not None:
            self.queued_since.append((now, rid))
        if sc.request_timeout_s is not None:
            self.running_since.append((now, rid))
        for seq in seqs:
            self.scheduler.add(seq, waits_for_grammar=rid in self.grammar_futures)

    def _admit(self, num_seqs: int) -> None:
        limit = self.config.scheduler_config.max_waiting
        if limit is None:
            return
        if num_seqs > limit:
            raise ValueError(f"n={num_seqs} is more than the engine's queue holds (max_waiting={limit})")
        if len(self.scheduler.waiting) + num_seqs > limit:
            raise EngineOverloadedError(f"the engine's waiting queue is full (max_waiting={limit} sequences)")

    def _max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens resolved, once: within the context window (validation checked that an
        explicit value fits it) and the whole KV cache; None fills what is left."""
        bm, limit = self.block_manager, self.config.model_config.max_model_len
        blocks_needed = prompt_len // bm.block_size + 1
        if blocks_needed > bm.num_blocks:
            raise ValueError(f"prompt length {prompt_len} needs {blocks_needed} KV blocks but the "
                             f"cache has {bm.num_blocks}")
        room = min(limit, bm.num_blocks * bm.block_size) - prompt_len
        if self.config.model_config.task == "embed":  # its one "token" is the pooled vector
            return 1
        return room if max_tokens is None else min(max_tokens, room)

    def abort(self, request_id: str, reason: str = "abort", stop_reason: str | None = None,
              index: int | None = None) -> list[EngineOutput]:
        """Finish a request (or one of its n completions); unknown or finished ids are a no-op."""
        seqs = self.requests.unfinished(request_id, index)
        for seq in seqs:
            self.scheduler.finish(seq, reason, stop_reason)
        outputs = [self._output(s, []) for s in seqs]
        self._retire(seqs)
        return outputs

    def has_unfinished(self) -> bool:
        """Requests not finished, or steps still on the workers (drain them too)."""
        return bool(self.requests) or bool(self.in_flight)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs = self._launch()
        if self.in_flight:
            plan, result = self.in_flight.popleft()
            return outputs + self._update(plan, result.result())
        if not outputs and (self.grammar_futures or self.scheduler.tier_copies_pending):
            time.sleep(GRAMMAR_POLL_S)
        return outputs

    async def step_async(self) -> list[EngineOutput]:
        outputs = self._launch()
        if self.in_flight:
            plan, result = self.in_flight.popleft()
            return outputs + self._update(plan, await asyncio.wrap_future(result))
        if not outputs and (self.grammar_futures or self.scheduler.tier_copies_pending):
            await asyncio.sleep(GRAMMAR_POLL_S)
        return outputs

    def _launch(self) -> list[EngineOutput]:
        """Plan and submit steps until `depth` are in flight; returns the requests that failed
        before it (a grammar compile, a deadline)."""
        failed = self._poll_grammars() + self._expire()
        while len(self.in_flight) < self.depth:
            plan = self.scheduler.schedule()
            if plan is None:
                break
            self.in_flight.append((plan, self.executor.submit(encode(plan))))
        return failed

    def _update(self, plan: StepPlan, result_bytes: bytes | None) -> list[EngineOutput]:
        result = decode(result_bytes, StepResult) if result_bytes else StepResult(plan.step, [], [])
        if result.kv_tier is not None:
            self.kv_tier = result.kv_tier
        self._collect_prompt_logprobs(plan, result)
        emitted = self.scheduler.update(plan, result)
        outputs = []
        for seq, new, row in emitted:
            out = self._output(seq, new, _rows(result.logprobs, row, len(new)))
            out.embedding = result.embeddings.get(seq.request_id)
            if seq.first_token_time is None:
                seq.first_token_time = time.monotonic()
                self.prompt_tokens += seq.num_prompt_tokens
                out.prompt_logprobs = _prompt_logprobs(seq)
            outputs.append(out)
            self.generation_tokens += len(new)
        self._retire([e.request for e in emitted if e.request.is_finished])
        return outputs

    def warm_up(self, prompt_len: int = 48, max_tokens: int = 4) -> None:
        """Run short greedy and random requests through the step (prefill, decode, the
        sampler's paths, logprobs) so one-time set-up costs are not paid by the first real
        requests. The prefix cache and the counters are reset afterwards."""
        vocab = self.config.model_config.vocab_size
        prompt = [(7919 * i + 13) % vocab for i in range(prompt_len)]
        kinds = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                 SamplingParams(temperature=0.8, top_p=0.9, top_k=40, max_tokens=max_tokens,
                                ignore_eos=True, logprobs=1, seed=0)]
        prompts = [prompt] * len(kinds)
        if self.scheduler.drafter is not None:  # a repeating prompt, so that drafts are verified too
            period = prompt[: max(2, prompt_len // 4)]
            prompts.append((period * 4)[:prompt_len])
            kinds.append(kinds[0])
        for i, (p, params) in enumerate(zip(prompts, kinds)):  # not counted against max_waiting
            self._queue(EngineRequest(f"warm-up-{i}", p, params), self._max_tokens(len(p), max_tokens))
        tier, self.scheduler.tier = self.scheduler.tier, None  # made-up prompts stay out of the KV tier
        try:
            while self.has_unfinished():
                self.step()
        finally:
            self.scheduler.tier = tier
        self.block_manager.reset_prefix_cache()
        for owner in (self.block_manager, self.scheduler, self):
            owner.reset_stats()

    # ---- helpers ------------------------------------------------------------------------
    def _collect_prompt_logprobs(self, plan: StepPlan, result: StepResult) -> None:
        """Append each prefill chunk's prompt logprobs where the chunk starts. A preempted
        request recomputes its prompt from position 0 (no prefix-cache hits for it): that
        starts the list again, and a chunk of the computation it abandoned is dropped."""
        if not result.prompt_logprobs:
            return
        starts = {new.req_id: new.num_computed_tokens for new in plan.new_requests}
        starts.update(zip(plan.cached.req_ids, plan.cached.num_computed_tokens))
        for rid, lp in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is None or req.first_token_time is not None:
                continue  # finished, or they went out with its first token
            if starts[rid] == 0:
                req.prompt_logprobs = Logprobs([], [], [])
            elif req.prompt_logprobs is None or len(req.prompt_logprobs.token_ids) != starts[rid]:
                continue
            req.prompt_logprobs.token_ids += lp.token_ids
            req.prompt_logprobs.logprobs += lp.logprobs
            req.prompt_logprobs.ranks += lp.ranks

    def _output(self, seq: Request, tokens: list[int], logprobs: Logprobs | None = None) -> EngineOutput:
        rid, index = self.requests.output_of(seq)
        return EngineOutput(rid, tokens, new_logprobs=logprobs, finish_reason=seq.finish_reason,
                            stop_reason=seq.stop_reason, error=seq.error, error_code=seq.error_code,
                            index=index, num_prompt_tokens=seq.num_prompt_tokens,
                            num_cached_tokens=max(seq.num_cached_tokens, 0))

    def _retire(self, finished: list[Request]) -> None:
        """Count finished completions; forget requests whose completions have all finished."""
        for seq in finished:
            self.finished[seq.finish_reason] = self.finished.get(seq.finish_reason, 0) + 1
            rid = self.requests.retire(seq)
            if rid is not None:
                self.grammar_futures.pop(rid, None)

    def _poll_grammars(self) -> list[EngineOutput]:
        """Release requests whose grammar compiled; fail those whose compile failed."""
        failed: list[EngineOutput] = []
        for rid, fut in list(self.grammar_futures.items()):
            if not fut.done():
                continue
            del self.grammar_futures[rid]
            try:
                grammar = fut.result()
            except Exception as exc:  # compile error or timeout: only this request fails
                failed += self._fail(rid, f"grammar compilation failed: {exc}")
                continue
            for seq in self.requests.unfinished(rid):
                self.scheduler.grammar_ready(seq, grammar)
        return failed

    def _expire(self) -> list[EngineOutput]:
        """End the requests past a deadline: still queued (no sequence started) after
        max_queue_wait_s, unfinished after request_timeout_s. Both queues are in admission
        order, so only their heads are looked at; a request gone from the engine is dropped."""
        sc, now, failed = self.config.scheduler_config, time.monotonic(), []
        while self.queued_since and now - self.queued_since[0][0] > sc.max_queue_wait_s:
            rid = self.queued_since.popleft()[1]
            seqs = self.requests.unfinished(rid)
            if seqs and all(s.status in _QUEUED for s in seqs):
                failed += self._fail(rid, f"waited in the queue for more than max_queue_wait_s="
                                          f"{sc.max_queue_wait_s:g} s", QUEUE_TIMEOUT)
        while self.running_since and now - self.running_since[0][0] > sc.request_timeout_s:
            rid = self.running_since.popleft()[1]
            failed += self._fail(rid, f"not finished within request_timeout_s={sc.request_timeout_s:g} s",
                                 REQUEST_TIMEOUT)
        return failed

    def _fail(self, rid: str, error: str, code: str | None = None) -> list[EngineOutput]:
        """End every unfinished sequence of a request with finish_reason "error"."""
        seqs = self.requests.unfinished(rid)
        for seq in seqs:
            self.scheduler.finish(seq, "error", error=error)
            seq.error_code = code
        outputs = [self._output(s, []) for s in seqs]
        self._retire(seqs)
        return outputs

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        stats = EngineStats(
            running=len(s.running), waiting=len(s.waiting), num_unfinished=len(self.requests),
            kv_usage=bm.usage, num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            preemptions=s.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits + (s.tier.hit_tokens if s.tier else 0),  # the tier's: read, not computed
            prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, finished=dict(self.finished))
        d = s.drafter
        if d is not None and d.num_drafts:
            stats.spec_decode_num_drafts = d.num_drafts
            stats.spec_decode_num_draft_tokens = d.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = d.num_accepted_tokens
            stats.spec_decode_mean_acceptance_length = 1.0 + d.num_accepted_tokens / d.num_drafts
        if s.tier is not None:
            self._kv_tier_stats(stats)
        if s.lora_slots is not None:
            stats.lora_requests = dict(self.lora_requests)
            stats.lora_resident = s.lora_slots.resident()
            stats.lora_slot_loads = s.lora_slots.num_loads
            stats.lora_load_seconds = dict(self.loras.load_seconds)
        return stats

    def _kv_tier_stats(self, stats: EngineStats) -> None:
        s, now, base = self.scheduler, self.kv_tier, self.kv_tier_base
        stats.kv_tier_hit_tokens, stats.kv_tier_load_failures = s.tier.hit_tokens, s.tier.load_failures
        stats.kv_tier_promotions, stats.kv_tier_writes_held = s.tier.promotions, s.tier.writes_held
        for name in KVTierCounters.__struct_fields__:
            setattr(stats, f"kv_tier_{name}", getattr(now, name) - getattr(base, name))

    def prefix_cache_summary(self, limit: int | None = None) -> PrefixCacheSummary:
        """The prefix cache's contents for a router (cluster/routing.py), `limit` keys at most."""
        slots, tier = self.scheduler.lora_slots, self.scheduler.tier
        salts = [a.cache_salt for a in slots.slots if a is not None] if slots is not None else []
        return self.reporter.summary(self.scheduler.waiting, self.num_added, limit, salts,
                                     slots.num_loads if slots is not None else 0,
                                     tier.store.routing_keys(limit) if tier is not None else (0, []))


_QUEUED = (RequestStatus.WAITING, RequestStatus.WAITING_FOR_GRAMMAR)


def _prompt_logprobs(seq: Request) -> Logprobs | None:
    """What the request's prefill gathered, if it asked; a one-token prompt has no position
    to score, so its list is empty (the first prompt token never has a logprob)."""
    if seq.sampling_params.prompt_logprobs is None:
        return None
    return Logprobs([], [], []) if seq.prompt_logprobs is None else seq.prompt_logprobs


def _rows(lp: Logprobs | None, start: int, count: int) -> Logprobs | None:
    if lp is None or not count or not lp.token_ids[start]:
        return None
    end = start + count
    return Logprobs(lp.token_ids[start:end], lp.logprobs[start:end], lp.ranks[start:end])
