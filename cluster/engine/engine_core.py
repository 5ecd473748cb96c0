"""The engine in one object: admission, add / abort, and the step.

`EngineCore` owns every request from entry to finish. Each step polls the grammar compiles,
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
import itertools
import time
from collections import deque
from concurrent.futures import Future
from typing import Protocol

import msgspec

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager, prompt_routing_keys
from cluster.engine.input_processor import InputProcessor
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler
from cluster.errors import EngineOverloadedError
from cluster.messages import (EngineOutput, EngineRequest, Logprobs, PrefixCacheSummary, StepPlan, StepResult,
                              decode, encode)
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


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.config, self.executor, self.grammar_compiler = config, executor, grammar_compiler
        cc = config.cache_config
        self.block_manager = BlockManager(executor.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.inputs = InputProcessor(config)
        self.children: dict[str, list[Request]] = {}  # parent id -> its n requests
        self.parent_of: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)
        self.grammar_futures: dict[str, Future] = {}  # parent id -> compile future
        self.prompt_tokens = self.generation_tokens = 0
        self.finished: dict[str, int] = {}
        self.num_added = 0  # requests admitted since start (a summary's version moves with it)
        self._queued_keys: dict[str, list[int]] = {}  # routing keys of queued prompts, by request id
        self._summary: PrefixCacheSummary | None = None
        self._summary_limit: int | None = None
        self.in_flight: deque[tuple[StepPlan, Future]] = deque()  # submitted, oldest first
        self.depth = 2 if config.scheduler_config.async_scheduling else 1

    # ---- entry ------------------------------------------------------------------------
    def validate(self, request: EngineRequest) -> EngineRequest:
        """Every entry check (ValueError naming the field); returns the request to queue."""
        params = self.inputs.process(request.prompt_token_ids, request.sampling_params, request.priority)
        if params.structured_outputs is not None and self.grammar_compiler is None:
            raise ValueError("structured_outputs needs a grammar compiler; none is configured")
        self._max_tokens(len(request.prompt_token_ids), params.max_tokens)
        return msgspec.structs.replace(request, sampling_params=params)

    def add_request(self, request: EngineRequest) -> None:
        """Validate, admit and queue. ValueError (bad input) or EngineOverloadedError (the
        waiting queue is full) leave the engine exactly as it was."""
        rid = request.request_id
        if rid in self.children:
            raise ValueError(f"request_id {rid!r} is already running")
        request = self.validate(request)
        params = request.sampling_params
        self._admit(params.n)
        max_tokens = self._max_tokens(len(request.prompt_token_ids), params.max_tokens)
        arrival = time.monotonic()  # one for all n: they form one group, ordered by it
        kids = [self._child(request, i, max_tokens, arrival) for i in range(params.n)]
        if params.structured_outputs is not None:
            self.grammar_futures[rid] = self.grammar_compiler.submit(params.structured_outputs)
            for kid in kids:
                kid.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.children[rid] = kids
        self.num_added += 1
        for i, kid in enumerate(kids):
            self.parent_of[kid.request_id] = (rid, i)
            self.scheduler.add(kid)

    def _admit(self, num_seqs: int) -> None:
        limit = self.config.scheduler_config.max_waiting
        if limit is None:
            return
        if num_seqs > limit:
            raise ValueError(f"n={num_seqs} is more than the engine's queue holds (max_waiting={limit})")
        if len(self.scheduler.waiting) + num_seqs > limit:
            raise EngineOverloadedError(f"the engine's waiting queue is full (max_waiting={limit} sequences)")

    def _child(self, request: EngineRequest, i: int, max_tokens: int, arrival: float) -> Request:
        params, group = request.sampling_params, request.group_id or request.request_id
        common = dict(arrival_time=arrival, priority=request.priority, group_id=group)
        if params.n == 1:
            return Request(request.request_id, list(request.prompt_token_ids), params, max_tokens, **common)
        seed = None if params.seed is None else params.seed + i
        return Request(f"{request.request_id}#{i}", list(request.prompt_token_ids),
                       params.clone(n=1, seed=seed), max_tokens, parent_id=request.request_id, **common)

    def _max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        """max_tokens resolved against the whole KV cache (the context window is checked at
        entry: past it is a ValueError); None fills what is left."""
        bm, limit = self.block_manager, self.config.model_config.max_model_len
        blocks_needed = prompt_len // bm.block_size + 1
        if blocks_needed > bm.num_blocks:
            raise ValueError(f"prompt length {prompt_len} needs {blocks_needed} KV blocks but the "
                             f"cache has {bm.num_blocks}")
        room = min(limit, bm.num_blocks * bm.block_size) - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    def abort(self, request_id: str, reason: str = "abort", stop_reason: str | None = None,
              index: int | None = None) -> list[EngineOutput]:
        """Finish a request (or one of its n completions); unknown or finished ids are a no-op."""
        kids = self.children.get(request_id, [])
        if index is not None:
            kids = kids[index:index + 1]
        kids = [k for k in kids if not k.is_finished]
        for kid in kids:
            self.scheduler.finish(kid, reason, stop_reason)
        outputs = [self._output(k, []) for k in kids]
        self._retire(kids)
        return outputs

    def has_unfinished(self) -> bool:
        """Requests not finished, or steps still on the workers (drain them too)."""
        return bool(self.children) or bool(self.in_flight)

    # ---- the step -----------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        outputs = self._launch()
        if self.in_flight:
            plan, result = self.in_flight.popleft()
            return outputs + self._update(plan, result.result())
        if not outputs and self.grammar_futures:
            time.sleep(GRAMMAR_POLL_S)
        return outputs

    async def step_async(self) -> list[EngineOutput]:
        outputs = self._launch()
        if self.in_flight:
            plan, result = self.in_flight.popleft()
            return outputs + self._update(plan, await asyncio.wrap_future(result))
        if not outputs and self.grammar_futures:
            await asyncio.sleep(GRAMMAR_POLL_S)
        return outputs

    def _launch(self) -> list[EngineOutput]:
        """Plan and submit steps until `depth` are in flight; returns failed grammar compiles."""
        failed = self._poll_grammars()
        while len(self.in_flight) < self.depth:
            plan = self.scheduler.schedule()
            if plan is None:
                break
            self.in_flight.append((plan, self.executor.submit(encode(plan))))
        return failed

    def _update(self, plan: StepPlan, result_bytes: bytes | None) -> list[EngineOutput]:
        result = decode(result_bytes, StepResult) if result_bytes else StepResult(plan.step, [], [])
        self._collect_prompt_logprobs(plan, result)
        requests = self.scheduler.requests
        before = {rid: requests[rid].num_output_tokens for rid in result.req_ids if rid in requests}
        first_row, row = {}, 0  # each request's first logprobs row
        for rid, tokens in zip(result.req_ids, result.sampled_token_ids):
            first_row[rid], row = row, row + len(tokens)
        touched = self.scheduler.update(plan, result)
        outputs = []
        for req in touched:
            # A stop can end a request before all of its emitted tokens are appended.
            new = req.output_token_ids[before[req.request_id]:]
            out = self._output(req, new, _rows(result.logprobs, first_row[req.request_id], len(new)))
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
                self.prompt_tokens += req.num_prompt_tokens
                out.prompt_logprobs = req.prompt_logprobs
            outputs.append(out)
            self.generation_tokens += len(new)
        self._retire([r for r in touched if r.is_finished])
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
        drafter = self.scheduler.drafter
        if drafter is not None:  # a repeating prompt, so that drafts are verified too
            period = prompt[: max(2, prompt_len // 4)]
            prompts.append((period * 4)[:prompt_len])
            kinds.append(kinds[0])
        for i, (p, params) in enumerate(zip(prompts, kinds)):
            self.add_request(EngineRequest(f"warm-up-{i}", p, params))
        while self.has_unfinished():
            self.step()
        self.block_manager.reset_prefix_cache()
        self.block_manager.prefix_cache_queries = self.block_manager.prefix_cache_hits = 0
        self.scheduler.num_preemptions = self.prompt_tokens = self.generation_tokens = 0
        if drafter is not None:
            drafter.num_drafts = drafter.num_draft_tokens = drafter.num_accepted_tokens = 0
        self.finished.clear()

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

    def _output(self, req: Request, tokens: list[int], logprobs: Logprobs | None = None) -> EngineOutput:
        parent, index = self.parent_of.get(req.request_id, (req.request_id, 0))
        return EngineOutput(parent, tokens, new_logprobs=logprobs, finish_reason=req.finish_reason,
                            stop_reason=req.stop_reason, error=req.error, index=index,
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=max(req.num_cached_tokens, 0))

    def _retire(self, finished: list[Request]) -> None:
        """Count finished completions; forget parents whose children have all finished."""
        for req in finished:
            self.finished[req.finish_reason] = self.finished.get(req.finish_reason, 0) + 1
            parent, _ = self.parent_of.pop(req.request_id, (req.request_id, 0))
            kids = self.children.get(parent, [])
            if all(k.is_finished for k in kids):
                self.children.pop(parent, None)
                self.grammar_futures.pop(parent, None)

    def _poll_grammars(self) -> list[EngineOutput]:
        """Release requests whose grammar compiled; fail those whose compile failed."""
        failed: list[EngineOutput] = []
        for parent, fut in list(self.grammar_futures.items()):
            if not fut.done():
                continue
            del self.grammar_futures[parent]
            kids = self.children.get(parent, [])
            try:
                grammar = fut.result()
            except Exception as exc:  # compile error or timeout: only this request fails
                for kid in kids:
                    self.scheduler.finish(kid, "error", error=f"grammar compilation failed: {exc}")
                failed += [self._output(k, []) for k in kids]
                self._retire(kids)
                continue
            for kid in kids:
                kid.grammar = grammar
                if kid.status is RequestStatus.WAITING_FOR_GRAMMAR:
                    kid.status = RequestStatus.WAITING
        return failed

    def stats(self) -> EngineStats:
        s, bm = self.scheduler, self.block_manager
        stats = EngineStats(
            running=len(s.running), waiting=len(s.waiting), num_unfinished=len(self.children),
            kv_usage=bm.usage, num_free_blocks=bm.num_free_blocks, num_blocks=bm.num_blocks,
            preemptions=s.num_preemptions, prefix_cache_queries=bm.prefix_cache_queries,
            prefix_cache_hits=bm.prefix_cache_hits, prompt_tokens=self.prompt_tokens,
            generation_tokens=self.generation_tokens, finished=dict(self.finished))
        d = s.drafter
        if d is not None and d.num_drafts:
            stats.spec_decode_num_drafts = d.num_drafts
            stats.spec_decode_num_draft_tokens = d.num_draft_tokens
            stats.spec_decode_num_accepted_tokens = d.num_accepted_tokens
            stats.spec_decode_mean_acceptance_length = 1.0 + d.num_accepted_tokens / d.num_drafts
        return stats

    def prefix_cache_summary(self, limit: int | None = None) -> PrefixCacheSummary:
        """The prefix cache's contents for a router: cached blocks in use, then the blocks of
        prompts still queued (computed soon, so a router should count them), then free cached
        blocks, most recently freed first; `limit` keys at most. Cheap when nothing changed."""
        bm = self.block_manager
        version = bm.cache_version + self.num_added
        if self._summary is not None and (self._summary.version, self._summary_limit) == (version, limit):
            return self._summary
        queued = [r for r in self.scheduler.waiting if r.num_computed_tokens == 0]
        self._queued_keys = {r.request_id: self._queued_keys.get(r.request_id)
                             or prompt_routing_keys(r.prompt_token_ids, bm.block_size) for r in queued}
        in_use, free = bm.cached_keys(in_use=True), bm.cached_keys(in_use=False)
        keys = list(dict.fromkeys(itertools.chain(in_use, *self._queued_keys.values(), free)))
        self._summary = PrefixCacheSummary(bm.block_size, version, keys[:limit], len(bm.cached))
        self._summary_limit = limit
        return self._summary


def _rows(lp: Logprobs | None, start: int, count: int) -> Logprobs | None:
    if lp is None or not count or not lp.token_ids[start]:
        return None
    end = start + count
    return Logprobs(lp.token_ids[start:end], lp.logprobs[start:end], lp.ranks[start:end])
