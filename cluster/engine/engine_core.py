"""The engine loop in one object: entry, scheduling, one step on the workers, outputs.

`step()` runs a whole step synchronously (offline `LLM`). The Ray engine deployment splits
it into `begin_step()` (plan bytes for every worker) and `end_step()` (rank 0's result) so
it can await the workers between the two.
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.config import EngineConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.input_processor import InputProcessor
from cluster.engine.request import Request, RequestStatus
from cluster.engine.scheduler import Scheduler
from cluster.messages import EngineOutput, EngineRequest, Logprobs, StepPlan, StepResult, decode, encode
from cluster.sampling_params import StructuredOutputsParams
from cluster.tokenizer import Tokenizer


class Executor(Protocol):
    num_kv_blocks: int

    def execute(self, plan_bytes: bytes) -> bytes: ...


class GrammarCompiler(Protocol):
    def submit(self, params: StructuredOutputsParams) -> Future: ...


@dataclass
class EngineStats:
    """Counters for metrics; the Ray layer exports them."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor, tokenizer: Tokenizer,
                 grammar_compiler: GrammarCompiler | None = None) -> None:
        self.config, self.executor, self.tokenizer = config, executor, tokenizer
        cc = config.cache_config
        self.block_manager = BlockManager(executor.num_kv_blocks, cc.block_size, cc.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.block_manager)
        self.inputs = InputProcessor(config, tokenizer)
        self.grammar_compiler = grammar_compiler
        self.eos_token_id = tokenizer.eos_token_id
        self.capacity = self.block_manager.num_blocks * cc.block_size
        self.children: dict[str, list[Request]] = {}  # parent id -> its n requests
        self.parent_of: dict[str, tuple[str, int]] = {}  # child id -> (parent id, index)
        self.grammar_futures: dict[str, Future] = {}  # parent id -> compile future
        self.stats = EngineStats()
        self._grammar_failures: list[EngineOutput] = []

    # ---- entry ------------------------------------------------------------------------
    def add_request(self, request: EngineRequest) -> None:
        """Validate and queue; a ValueError leaves the engine exactly as it was."""
        rid = request.request_id
        if rid in self.children:
            raise ValueError(f"request_id {rid!r} is already running")
        params = self.inputs.process(request.prompt_token_ids, request.sampling_params)
        max_tokens = self._resolve_max_tokens(len(request.prompt_token_ids), params.max_tokens)
        if params.structured_outputs is not None and self.grammar_compiler is None:
            raise ValueError("structured_outputs needs a grammar compiler; none is configured")
        kids = []
        for i in range(params.n):
            child_params = params if params.n == 1 else params.clone(
                n=1, seed=None if params.seed is None else params.seed + i)
            child_id = rid if params.n == 1 else f"{rid}#{i}"
            kids.append(Request(child_id, list(request.prompt_token_ids), child_params,
                                self.eos_token_id, max_tokens,
                                parent_id=rid if params.n > 1 else None))
        if params.structured_outputs is not None:
            self.grammar_futures[rid] = self.grammar_compiler.submit(params.structured_outputs)
            for kid in kids:
                kid.status = RequestStatus.WAITING_FOR_GRAMMAR
        self.children[rid] = kids
        for i, kid in enumerate(kids):
            self.parent_of[kid.request_id] = (rid, i)
            self.scheduler.add(kid)

    def _resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int:
        limit = self.config.model_config.max_model_len
        blocks_needed = prompt_len // self.config.cache_config.block_size + 1
        if blocks_needed > self.block_manager.num_blocks:
            raise ValueError(f"prompt length {prompt_len} needs {blocks_needed} KV blocks but the "
                             f"cache has {self.block_manager.num_blocks}")
        room = min(limit, self.capacity) - prompt_len
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
        return bool(self.children)

    # ---- the step -----------------------------------------------------------------------
    def begin_step(self) -> tuple[StepPlan, bytes] | None:
        self._poll_grammars()
        plan = self.scheduler.schedule()
        return None if plan is None else (plan, encode(plan))

    def end_step(self, plan: StepPlan, result_bytes: bytes | None) -> list[EngineOutput]:
        result = decode(result_bytes, StepResult) if result_bytes else StepResult(plan.step, [], [])
        self._collect_prompt_logprobs(result)
        touched = self.scheduler.update(plan, result)
        index = {rid: i for i, rid in enumerate(result.req_ids)}
        outputs = []
        for req in touched:
            out = self._output(req, [req.output_token_ids[-1]], _row(result.logprobs, index[req.request_id]))
            if req.first_token_time is None:
                req.first_token_time = time.monotonic()
                self.stats.prompt_tokens += req.num_prompt_tokens
                out.prompt_logprobs = req.prompt_logprobs
            self.stats.generation_tokens += 1
            outputs.append(out)
        self._retire([r for r in touched if r.is_finished])
        return outputs + self._drain_grammar_failures()

    def step(self) -> list[EngineOutput]:
        started = self.begin_step()
        if started is None:
            return self._drain_grammar_failures()
        plan, data = started
        return self.end_step(plan, self.executor.execute(data))

    # ---- helpers ------------------------------------------------------------------------
    def _collect_prompt_logprobs(self, result: StepResult) -> None:
        for rid, lp in result.prompt_logprobs.items():
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            if req.prompt_logprobs is None:
                req.prompt_logprobs = Logprobs([], [], [])
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
        """Forget parents whose children have all finished."""
        for req in finished:
            self.stats.finished[req.finish_reason] = self.stats.finished.get(req.finish_reason, 0) + 1
            parent, _ = self.parent_of.pop(req.request_id, (req.request_id, 0))
            kids = self.children.get(parent, [])
            if all(k.is_finished for k in kids):
                self.children.pop(parent, None)
                self.grammar_futures.pop(parent, None)

    def _poll_grammars(self) -> None:
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
                self._grammar_failures += [self._output(k, []) for k in kids]
                self._retire(kids)
                continue
            for kid in kids:
                kid.grammar = grammar
                if kid.status is RequestStatus.WAITING_FOR_GRAMMAR:
                    kid.status = RequestStatus.WAITING

    def _drain_grammar_failures(self) -> list[EngineOutput]:
        out, self._grammar_failures = self._grammar_failures, []
        return out

    def stats_snapshot(self) -> dict[str, Any]:
        s, bm = self.scheduler, self.block_manager
        return {"running": len(s.running), "waiting": len(s.waiting), "kv_usage": bm.usage,
                "num_free_blocks": bm.num_free_blocks, "preemptions": s.num_preemptions,
                "prefix_cache_queries": bm.prefix_cache_queries, "prefix_cache_hits": bm.prefix_cache_hits,
                "prompt_tokens": self.stats.prompt_tokens, "generation_tokens": self.stats.generation_tokens}


def _row(lp: Logprobs | None, i: int) -> Logprobs | None:
    if lp is None or not lp.token_ids[i]:
        return None
    return Logprobs([lp.token_ids[i]], [lp.logprobs[i]], [lp.ranks[i]])
