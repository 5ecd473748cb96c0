"""Continuous batching over the paged KV cache, fair between requests.

Each step: running requests first (decodes and unfinished prefill chunks), then waiting ones
while the token budget, `max_num_seqs` and free blocks allow. Waiting sequences start in
`WaitingQueue` order: priority, then the request holding fewer sequences in the batch, then
arrival. When blocks run out a running sequence is preempted (its blocks freed; it is
recomputed later, its prefix often revived from the cache): the one with the highest key
`(priority, its request's other running sequences, arrival)`, i.e. the lowest priority, then
a child of the request holding most of the batch, then the newest. A waiting sequence may
also take the slot and blocks of a running one whose (priority, share) key is strictly higher,
so a small request arriving while an n = 128 request fills the batch starts in the next step
(unless running prefill chunks use that step's whole token budget). The result is a
`StepPlan`: a delta against the workers' state.

With the KV tier (cluster/kv_tier.py) on, every block the prefix cache registers is written through
to the tier after the step that completes it (`StepPlan.kv_saves`; not while the tier holds a
store whose writes are not read back), and a request whose prompt
continues in the tier past its pool hits starts with those blocks read into fresh blocks in the
step that starts it (`kv_loads`; tier_planner.py).

With speculative decoding a decoding request may also schedule draft tokens (n-gram
proposals, `cluster.spec`): they take KV slots and token budget like any other token, and
after the step the slots of rejected ones are released.

Progress is booked when a step is planned: its tokens count as computed and each request it
samples holds an output placeholder until `update` brings the token. So the next step can be
planned before this one has run (async scheduling): a decoding request schedules the position
of its placeholder, which the workers fill from their own sample. A request whose placeholders
would reach `max_tokens` is not scheduled again; one that stops on a token the engine has not
seen yet runs one step too many, and that step's token is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request, RequestStatus
from cluster.engine.tier_planner import TierPlanner
from cluster.engine.waiting_queue import Key, WaitingQueue
from cluster.kv_tier import TierStore
from cluster.lora.adapter import LoRAAdapter
from cluster.lora.slot_table import SlotTable
from cluster.messages import CachedRequests, KVBlock, KVLoad, LoRALoad, NewRequest, StepPlan, StepResult
from cluster.spec import Drafter


@dataclass
class _Step:
    """One schedule() call's running tally."""

    budget: int
    scheduled: dict[str, int] = field(default_factory=dict)  # request id -> tokens this step
    new_blocks: dict[str, list[int]] = field(default_factory=dict)
    preempted: list[Request] = field(default_factory=list)
    started: set[str] = field(default_factory=set)  # taken from the waiting queue this step
    # Once anyone was preempted, only sequences that outrank all of them may start this step.
    floor: Key | None = None
    drafts: dict[str, list[int]] = field(default_factory=dict)  # request id -> draft tokens
    lora_loads: list[LoRALoad] = field(default_factory=list)  # adapters the workers load first
    lora_prefetch: list[LoRAAdapter] = field(default_factory=list)  # adapters the workers read ahead
    kv_saves: dict[str, list[KVBlock]] = field(default_factory=dict)  # request id -> blocks it completes
    kv_loads: list[KVLoad] = field(default_factory=list)  # tier reads for requests started this step


class Emitted(NamedTuple):
    """What one step gave a request: its new tokens (fewer than it emitted when a stop ended
    it mid-draft) and its first row in the step's logprobs."""

    request: Request
    new_token_ids: list[int]
    logprobs_row: int


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, tier: TierStore | None = None) -> None:
        self.config = config.scheduler_config
        self.eos_token_id = config.model_config.eos_token_id
        self.bm = block_manager
        # An embedding model's mean pooling reads every prompt token's hidden state (worker/pooling.py).
        pooler = config.model_config.pooler_config
        self.pool_all_tokens = pooler is not None and pooler["pooling_type"] == "MEAN"
        self.num_running: dict[str, int] = {}  # group id -> its sequences in `running`
        self.waiting = WaitingQueue(self.num_running)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # told to the workers in the next plan
        self.step_id = 0
        self._resumed: set[str] = set()
        spec = config.speculative_config
        self.drafter = Drafter(spec) if spec is not None else None
        lc = config.lora_config
        self.lora_slots = SlotTable(lc.max_loras) if lc.enable_lora else None
        self.tier = TierPlanner(tier, block_manager.block_size) if tier is not None else None  # None: off
        if tier is not None:
            block_manager.new_cached = []
        self.reset_stats()
        self._freed_blocks: dict[str, int] = {}  # blocks of rejected drafts, told in the next plan

    def reset_stats(self) -> None:
        self.num_preemptions = 0
        if self.tier is not None:
            self.tier.reset_stats()
        if self.drafter is not None:
            self.drafter.reset_stats()

    @property
    def tier_copies_pending(self) -> bool:
        """Whether waiting requests wait for KV tier blocks being copied up from disk."""
        return self.tier is not None and bool(self.tier.promoting)

    # ---- queue management -------------------------------------------------------------
    def add(self, req: Request, waits_for_grammar: bool = False) -> None:
        """Queue a sequence; one that waits for its grammar is passed over until
        `grammar_ready` (it holds nobody up meanwhile)."""
        if waits_for_grammar:
            req.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def grammar_ready(self, req: Request, grammar: str) -> None:
        req.grammar = grammar
        if req.status is RequestStatus.WAITING_FOR_GRAMMAR:
            req.status = RequestStatus.WAITING

    def finish(self, req: Request, reason: str, stop_reason: int | str | None = None,
               error: str | None = None) -> None:
        """Finish a request anywhere in its life: free its blocks, tell the workers. O(1)
        for a waiting one, so aborting an n = max_n request is one quick call."""
        if req.is_finished:
            return
        if req.status is RequestStatus.RUNNING:
            self._stop_running(req)
        else:
            self.waiting.remove(req)
        req.finish(reason, stop_reason, error)
        if self.tier is not None:
            self.tier.forget(req.request_id)
        if req.lora_slot >= 0:
            self.lora_slots.release(req.lora_slot)
            req.lora_slot = -1
        self.bm.free(req.request_id)
        self.requests.pop(req.request_id, None)
        self._freed_blocks.pop(req.request_id, None)
        if self.drafter is not None:
            self.drafter.forget(req.request_id)
        if req.on_workers:
            self.finished_ids.append(req.request_id)

    def _start_running(self, req: Request) -> None:
        self.waiting.remove(req)
        self.running.append(req)
        req.status = RequestStatus.RUNNING
        self.num_running[req.group_id] = self.num_running.get(req.group_id, 0) + 1
        self.waiting.touch(req.group_id)

    def _stop_running(self, req: Request) -> None:
        self.running.remove(req)
        left = self.num_running.pop(req.group_id) - 1
        if left:
            self.num_running[req.group_id] = left
        self.waiting.touch(req.group_id)

    # ---- one step ---------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        st = _Step(self.config.max_num_batched_tokens)
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            if st.budget <= 0:
                break
            if req.num_output_tokens + req.num_output_placeholders >= req.max_tokens:
                continue  # its last token is being sampled
            n = min(req.num_tokens + req.num_output_placeholders - req.num_computed_tokens, st.budget)
            blocks = self._allocate_or_preempt(req, n, st)
            if blocks is not None:
                st.scheduled[req.request_id], st.new_blocks[req.request_id] = n, blocks
                st.budget -= n
        self._schedule_waiting(st)
        if self.drafter is not None and not st.preempted:
            self._schedule_drafts(st)
        if not st.scheduled and not self.finished_ids and not st.preempted and not st.lora_prefetch:
            return None
        return self._build_plan(st)

    def _schedule_drafts(self, st: _Step) -> None:
        """Draft tokens for the decoding requests, with what the step leaves: the token budget
        and free blocks no running or admitted request needed (so nobody is preempted or kept
        waiting to speculate). The bonus token counts against max_tokens too."""
        decoding = [r for r in self.running
                    if st.scheduled.get(r.request_id) == 1 and r.num_computed_tokens == r.num_tokens - 1]
        threshold = self.drafter.step_threshold(len(decoding))
        for req in decoding:  # every one, drafting or not: the drafter also scores shadow drafts
            rid = req.request_id
            room = min(st.budget, req.max_tokens - req.num_output_tokens - 1)
            draft = self.drafter.propose(rid, req.token_ids, room, threshold)
            if not draft:
                continue
            blocks = self.bm.allocate_slots(rid, req.token_ids, req.num_computed_tokens, 1 + len(draft),
                                            salt=req.cache_salt)
            if blocks is None:
                continue
            self._note_saves(rid, st)
            st.drafts[rid] = draft
            st.scheduled[rid] += len(draft)
            st.new_blocks[rid] = st.new_blocks[rid] + blocks
            st.budget -= len(draft)

    def _allocate_or_preempt(self, req: Request, n: int, st: _Step) -> list[int] | None:
        while True:
            blocks = self.bm.allocate_slots(req.request_id, req.token_ids, req.num_computed_tokens, n,
                                            salt=req.cache_salt)
            if blocks is not None:
                self._note_saves(req.request_id, st)
                return blocks
            victim = self._victim(st)
            self._preempt(victim, st)
            if victim is req:
                return None

    def _running_key(self, req: Request) -> Key:
        return req.priority, self.num_running[req.group_id] - 1, req.arrival_time, req.group_id

    def _victim(self, st: _Step) -> Request | None:
        """The running sequence to give up first (never one started this step)."""
        best, best_key = None, None
        for i, req in enumerate(self.running):
            if req.request_id not in st.started:
                key = (*self._running_key(req), i)  # among equals the latest started
                if best_key is None or key > best_key:
                    best, best_key = req, key
        return best

    def _preempt(self, req: Request, st: _Step) -> None:
        self._stop_running(req)
        # Blocks registered for the chunk planned for it this step stay uncomputed: uncached.
        self.bm.free(req.request_id, req.num_computed_tokens)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add(req)
        st.budget += st.scheduled.pop(req.request_id, 0)
        st.new_blocks.pop(req.request_id, None)
        st.kv_saves.pop(req.request_id, None)  # never computed
        st.preempted.append(req)
        key = self.waiting.key(req)
        st.floor = key if st.floor is None else min(st.floor, key)

    def _schedule_waiting(self, st: _Step) -> None:
        while st.budget > 0:
            req = self.waiting.peek()
            if req is None:
                break
            key = self.waiting.key(req)
            if st.floor is not None and key >= st.floor:
                break
            if (req.status is RequestStatus.WAITING_FOR_GRAMMAR or req.num_output_placeholders
                    or self._sibling_prefilling(req) or not self._adapter_slot_free(req, st)):
                # Does not hold anyone up. (A sequence preempted while a step samples for it
                # resumes once that token is in.)
                self.waiting.defer(req.group_id)
                continue
            # Prompt logprobs (and mean pooling) need every prompt position computed: no prefix-cache hits.
            reads_cache = req.sampling_params.prompt_logprobs is None and not self.pool_all_tokens
            cached_blocks, num_cached = (self.bm.get_computed_blocks(req.token_ids, req.cache_salt)
                                         if reads_cache else ([], 0))
            found = self.tier.found(req.token_ids, len(cached_blocks), req.cache_salt) \
                if reads_cache and self.tier is not None else []
            if found and not self.tier.ready(req.request_id, found):
                self.waiting.defer(req.group_id)  # its blocks are being copied up from disk
                continue
            num_ready = num_cached + len(found) * self.bm.block_size  # in its blocks before the forward
            n = min(req.num_tokens - num_ready, st.budget)
            blocks = self._make_room(req, key, num_ready, n, cached_blocks, st)
            if blocks is None:
                break
            self._note_saves(req.request_id, st)
            if found:
                hits = len(cached_blocks)
                st.kv_loads.append(self.tier.load(req.request_id, hits, blocks[hits: hits + len(found)], found))
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_ready
            if req.status is RequestStatus.PREEMPTED and req.on_workers:
                self._resumed.add(req.request_id)
            req.num_computed_tokens = num_ready
            self._start_running(req)
            self._hold_adapter_slot(req, st)
            st.started.add(req.request_id)
            st.scheduled[req.request_id], st.new_blocks[req.request_id] = n, blocks
            st.budget -= n
        self.waiting.restore()

    def _adapter_slot_free(self, req: Request, st: _Step) -> bool:
        """Whether `req` has, or can have, a slot for its adapter (cluster/lora/slot_table.py).
        A request whose adapter is in no slot first announces it to the workers, which read it
        ahead, and waits one step: its load is then a copy in memory, not a disk read on the step."""
        slots = self.lora_slots
        if req.lora is None or req.lora_slot >= 0 or slots.slot_of(req.lora) is not None:
            return True
        if not req.lora_announced:  # once per request: no set to evict, so no request waits forever
            req.lora_announced = True
            if req.lora not in st.lora_prefetch:
                st.lora_prefetch.append(req.lora)
            return False
        return slots.can_take(req.lora)

    def _hold_adapter_slot(self, req: Request, st: _Step) -> None:
        if req.lora is not None and req.lora_slot < 0:
            req.lora_slot, load = self.lora_slots.take(req.lora)
            if load:
                st.lora_loads.append(LoRALoad(req.lora_slot, req.lora))

    def _make_room(self, req: Request, key: Key, num_cached: int, n: int, cached_blocks: list[int],
                   st: _Step) -> list[int] | None:
        """A slot and blocks for `req`, preempting running sequences whose (priority, share)
        is strictly worse than its own; None (nothing allocated) if that is not enough."""
        while True:
            if len(self.running) < self.config.max_num_seqs:
                blocks = self.bm.allocate_slots(req.request_id, req.token_ids, num_cached, n, cached_blocks,
                                                salt=req.cache_salt)
                if blocks is not None:
                    return blocks
            victim = self._victim(st)
            if victim is None or self._running_key(victim)[:2] <= key[:2]:
                return None
            self._preempt(victim, st)

    def _note_saves(self, req_id: str, st: _Step) -> None:
        """The blocks just registered for `req_id` that the tier lacks: written after the step.
        (Popped even while the tier is set aside, as in the engine's warm-up.)"""
        new = self.bm.pop_new_cached()
        if self.tier is not None and new:
            saves = self.tier.saves(new)
            if saves:
                st.kv_saves.setdefault(req_id, []).extend(saves)

    def _sibling_prefilling(self, req: Request) -> bool:
        """Completions of one n > 1 request wait while a sibling computes prompt blocks that
        are not cached yet, so they share its blocks instead of recomputing them. Once one
        sibling's prompt is cached the rest start together (each recomputes only the tail)."""
        if req.parent_id is None or not self.bm.enable_prefix_caching or \
                req.sampling_params.prompt_logprobs is not None:
            return False
        full = (req.num_prompt_tokens - 1) // self.bm.block_size * self.bm.block_size
        return any(r.parent_id == req.parent_id and r.num_computed_tokens < r.num_prompt_tokens
                   and r.num_cached_tokens < full for r in self.running)

    def _build_plan(self, st: _Step) -> StepPlan:
        self.step_id += 1
        new_reqs: list[NewRequest] = []
        cached = CachedRequests([], [], [], [], [])
        sample_ids: list[str] = []
        for req_id, n in st.scheduled.items():
            req = self.requests[req_id]
            computed = n - len(st.drafts.get(req_id, ()))  # accepted drafts are booked in update
            sampled = req.num_computed_tokens + computed == req.num_tokens + req.num_output_placeholders
            if sampled:
                sample_ids.append(req_id)
            if not req.on_workers:
                new_reqs.append(NewRequest(req_id, req.prompt_token_ids, req.sampling_params,
                                           self.bm.block_ids(req_id), req.num_computed_tokens,
                                           list(req.output_token_ids), req.grammar, req.lora_slot))
                req.on_workers = True
            else:
                resumed = req_id in self._resumed
                cached.req_ids.append(req_id)
                cached.new_block_ids.append(self.bm.block_ids(req_id) if resumed else st.new_blocks[req_id])
                cached.num_computed_tokens.append(req.num_computed_tokens)
                cached.resumed.append(resumed)
                freed = self._freed_blocks.pop(req_id, 0)
                cached.num_freed_blocks.append(0 if resumed else freed)
            req.num_computed_tokens += computed
            req.num_output_placeholders += sampled
        plan = StepPlan(self.step_id, new_reqs, cached, st.scheduled, sample_ids,
                        self.finished_ids, [r.request_id for r in st.preempted if r.on_workers],
                        st.drafts, st.lora_loads, st.lora_prefetch,
                        kv_saves=[b for rid in st.scheduled for b in st.kv_saves.get(rid, ())], kv_loads=st.kv_loads)
        self.finished_ids = []
        self._resumed.clear()
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Append the sampled tokens in place of the step's placeholders, apply EOS / stop ids
        / length limits (finishing the requests they end). Returns what each request that got
        tokens this step appended, finished ones included. A sequence preempted after this
        step was planned keeps its token: the workers have it too, and it resumes with it."""
        drafts = plan.draft_token_ids
        for req_id in plan.sample_ids:
            req = self.requests.get(req_id)
            if req is not None:
                req.num_output_placeholders -= 1
        if self.tier is not None:
            self.tier.reported(result)
        emitted: list[Emitted] = []
        row = 0
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids):
            req, first_row, row = self.requests.get(req_id), row, row + len(tokens)
            if req is None:
                continue  # finished (a stop seen after this step was planned, or an abort)
            if req_id in drafts:
                self._accept_drafts(req, len(drafts[req_id]), len(tokens) - 1)
            emitted.append(Emitted(req, self._append(req, tokens), first_row))
        return emitted

    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        """Append tokens one by one, each checked for a stop: one may end the request mid-draft."""
        for i, token in enumerate(tokens):
            req.append_token(token)
            reason = self._stop_reason(req, token)
            if reason is not None:
                self.finish(req, *reason)
                return tokens[:i + 1]
        return tokens

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
