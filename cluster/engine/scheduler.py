"""Continuous batching over the paged KV cache.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting ones
while the token budget, `max_num_seqs` and free blocks allow. When blocks run out the newest
running request is preempted (its blocks freed; it is recomputed later, its prefix often
revived from the cache). The result is a `StepPlan`: a delta against the workers' state.

With speculative decoding a decoding request may also schedule draft tokens (n-gram
proposals, `cluster.spec`): they take KV slots and token budget like any other token, and
after the step the slots of rejected ones are released.
"""
from __future__ import annotations

from collections import deque

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus
from cluster.messages import CachedRequests, NewRequest, StepPlan, StepResult
from cluster.spec import Drafter


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.config = config.scheduler_config
        self.eos_token_id = config.model_config.eos_token_id
        self.bm = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # told to the workers in the next plan
        self.step_id = 0
        self.num_preemptions = 0
        self._resumed: set[str] = set()
        spec = config.speculative_config
        self.drafter = Drafter(spec) if spec is not None else None
        self._freed_blocks: dict[str, int] = {}  # blocks of rejected drafts, told in the next plan

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """Finish a request anywhere in its life: free its blocks, tell the workers."""
        if req.is_finished:
            return
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason, stop_reason, error)
        self.bm.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._freed_blocks.pop(req.request_id, None)
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
        if req.on_workers:
            self.finished_ids.append(req.request_id)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []

        for req in list(self.running):
            if req not in self.running:  # preempted by an earlier iteration
                continue
            if budget <= 0:
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = self._allocate_or_preempt(req, n, preempted)
            if blocks is None:
                continue
            scheduled[req.request_id], new_blocks[req.request_id] = n, blocks
            budget -= n

        drafts: dict[str, list[int]] = {}
        if not preempted:
            budget = self._schedule_waiting(budget, scheduled, new_blocks)
            if self.drafter is not None:
                budget = self._schedule_drafts(budget, scheduled, new_blocks, drafts)
        if not scheduled and not self.finished_ids and not preempted:
            return None
        return self._build_plan(scheduled, new_blocks, preempted, drafts)

    def _schedule_drafts(self, budget: int, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                         drafts: dict[str, list[int]]) -> int:
        """Draft tokens for the decoding requests, with what the step leaves: the token budget
        and free blocks no running or admitted request needed (so nobody is preempted or kept
        waiting to speculate). The bonus token counts against max_tokens too."""
        decoding = [r for r in self.running
                    if scheduled.get(r.request_id) == 1 and r.num_computed_tokens == r.num_tokens - 1]
        threshold = self.drafter.step_threshold(len(decoding))
        for req in decoding:  # every one, drafting or not: the drafter also scores shadow drafts
            rid = req.request_id
            room = min(budget, req.max_tokens - req.num_output_tokens - 1)
            draft = self.drafter.propose(rid, req.token_ids, room, threshold)
            if not draft:
                continue
            blocks = self.bm.allocate_slots(rid, req.token_ids, req.num_computed_tokens, 1 + len(draft))
            if blocks is None:
                continue
            drafts[rid] = draft
            scheduled[rid] += len(draft)
            new_blocks[rid] = new_blocks[rid] + blocks
            budget -= len(draft)
        return budget

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> list[int] | None:
        while True:
            blocks = self.bm.allocate_slots(req.request_id, req.token_ids, req.num_computed_tokens, n)
            if blocks is not None:
                return blocks
            victim = self.running[-1]  # newest first
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int],
                          new_blocks: dict[str, list[int]]) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.popleft()
            if req.status is RequestStatus.WAITING_FOR_GRAMMAR or self._sibling_prefilling(req):
                skipped.append(req)  # does not hold anyone up
                continue
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            cached_blocks, num_cached = (self.bm.get_computed_blocks(req.token_ids)
                                         if req.sampling_params.prompt_logprobs is None else ([], 0))
            n = min(req.num_tokens - num_cached, budget)
            blocks = self.bm.allocate_slots(req.request_id, req.token_ids, num_cached, n, cached_blocks)
            if blocks is None:
                self.waiting.appendleft(req)
                break
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.status is RequestStatus.PREEMPTED and req.on_workers:
                self._resumed.add(req.request_id)
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id], new_blocks[req.request_id] = n, blocks
            budget -= n
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _sibling_prefilling(self, req: Request) -> bool:
        if req.parent_id is None:
            return False
        return any(r.parent_id == req.parent_id and r.num_computed_tokens < r.num_prompt_tokens
                   for r in self.running)

    def _build_plan(self, scheduled: dict[str, int], new_blocks: dict[str, list[int]],
                    preempted: list[Request], drafts: dict[str, list[int]]) -> StepPlan:
        self.step_id += 1
        new_reqs: list[NewRequest] = []
        cached = CachedRequests([], [], [], [], [], [])
        sample_ids: list[str] = []
        for req_id, n in scheduled.items():
            req = self.requests[req_id]
            if req.num_computed_tokens + n - len(drafts.get(req_id, ())) == req.num_tokens:
                sample_ids.append(req_id)
            if not req.on_workers:
                new_reqs.append(NewRequest(req_id, req.prompt_token_ids, req.sampling_params,
                                           self.bm.block_ids(req_id), req.num_computed_tokens,
                                           list(req.output_token_ids), req.grammar))
                req.on_workers = True
            else:
                resumed = req_id in self._resumed
                cached.req_ids.append(req_id)
                cached.new_token_ids.append(req.output_token_ids[req.num_sent_outputs:])
                cached.new_block_ids.append(self.bm.block_ids(req_id) if resumed else new_blocks[req_id])
                cached.num_computed_tokens.append(req.num_computed_tokens)
                cached.resumed.append(resumed)
                freed = self._freed_blocks.pop(req_id, 0)
                cached.num_freed_blocks.append(0 if resumed else freed)
            req.num_sent_outputs = req.num_output_tokens
        plan = StepPlan(self.step_id, new_reqs, cached, scheduled, sample_ids,
                        self.finished_ids, [r.request_id for r in preempted if r.on_workers], drafts)
        self.finished_ids = []
        self._resumed.clear()
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Advance progress, append sampled tokens, apply EOS / stop ids / length limits.
        Returns the requests that got a token this step (finished ones included)."""
        drafts = plan.draft_token_ids
        for req_id, n in plan.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is not None and req.status is RequestStatus.RUNNING:
                req.num_computed_tokens += n - len(drafts.get(req_id, ()))
        touched: list[Request] = []
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            req = self.requests.get(req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            touched.append(req)
            if req_id in drafts:
                self._accept_drafts(req, len(drafts[req_id]), len(tokens) - 1)
            for token in tokens:  # each checked in turn: a stop ends the request mid-draft
                req.append_token(token)
                reason = self._stop_reason(req, token)
                if reason is not None:
                    self.finish(req, *reason)
                    break
        return touched

    def _accept_drafts(self, req: Request, num_drafted: int, num_accepted: int) -> None:
        """The accepted drafts' KV is valid; the rejected ones' slots go back, except the one
        the token emitted now (computed next step) takes."""
        self.drafter.record(req.request_id, num_drafted, num_accepted)
        req.num_computed_tokens += num_accepted
        freed = self.bm.free_tail(req.request_id, req.num_computed_tokens + 1)
        if freed:
            self._freed_blocks[req.request_id] = self._freed_blocks.get(req.request_id, 0) + freed

    def _stop_reason(self, req: Request, token: int) -> tuple[str, int | None] | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            is_eos = token == self.eos_token_id
            if is_eos and (not sp.ignore_eos or req.needs_grammar):  # a grammar ends on eos
                return "stop", None
            if sp.stop_token_ids and token in sp.stop_token_ids:
                return "stop", token
        if req.num_output_tokens >= req.max_tokens:
            return "length", None
        return None
