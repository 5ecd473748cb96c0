"""The persistent batch: rank 0's per-row sampling state, kept across steps.

Rows are stable between steps: a new request takes the lowest freed row (else the end), and
leftover holes are filled by moving the highest live rows down (UNIDIRECTIONAL); rows are
never swapped (a processor must still handle SWAP, vLLM's interface). Every change is
recorded in a BatchUpdateBuilder, and `refresh` turns it into one BatchUpdate that every
processor consumes before the sampler runs. Per-row sampling parameters live in preallocated
tensors that move with their rows, so building the step's SamplingMetadata is a few slices
even at batch 64+ (vLLM's InputBatch idea).

Each step, in this order (vLLM's): remove_request* -> add_request* -> condense -> refresh.
Call refresh every step, even one with nothing to sample: it closes the step's changes (a
removal after condense, or an add after condense moved rows, cannot be expressed in one
BatchUpdate and raises RuntimeError).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.errors import EngineInternalError
from cluster.sample.logits_processor import BatchUpdateBuilder, LogitsProcessors, MoveDirectionality
from cluster.sample.metadata import SamplingMetadata
from cluster.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The worker's state for one request, kept across steps (and across preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    output_token_ids: list[int]  # the live list handed to logits processors
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None  # per-request, when a seed is set
    lora_slot: int = -1  # the adapter slot its rows use (-1: the base model)


def _uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class InputBatch:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str,
                 logitsprocs: LogitsProcessors | None = None) -> None:
        if max_num_reqs < 1:
            raise ValueError(f"max_num_reqs must be at least 1, got {max_num_reqs}")
        self.max_num_reqs, self.vocab_size = max_num_reqs, vocab_size
        self.device = torch.device(device)
        self.logitsprocs = logitsprocs if logitsprocs is not None else LogitsProcessors()
        self.batch_update_builder = BatchUpdateBuilder()

        self._req_ids: list[str | None] = []
        self._states: list[CachedRequestState | None] = []
        self.req_id_to_index: dict[str, int] = {}

        n = max_num_reqs
        self.temperature = torch.zeros(n, dtype=torch.float32)  # 0 = greedy
        self.top_p = torch.ones(n, dtype=torch.float32)
        self.top_k = torch.full((n,), vocab_size, dtype=torch.int64)  # vocab_size = off
        self.frequency_penalties = torch.zeros(n, dtype=torch.float32)
        self.presence_penalties = torch.zeros(n, dtype=torch.float32)
        self.repetition_penalties = torch.ones(n, dtype=torch.float32)
        self._row_tensors = (self.temperature, self.top_p, self.top_k, self.frequency_penalties,
                             self.presence_penalties, self.repetition_penalties)
        # Which requests use what, by id (ids survive moves untouched).
        self.greedy_reqs: set[str] = set()
        self.top_p_reqs: set[str] = set()
        self.top_k_reqs: set[str] = set()
        self.penalty_reqs: set[str] = set()
        self.allowed_reqs: set[str] = set()
        self.num_logprobs: dict[str, int] = {}
        # By row (moved with the rows).
        self.generators: dict[int, torch.Generator] = {}
        self.bad_words_token_ids: dict[int, list[list[int]]] = {}
        # [max_num_reqs, vocab] buffers on the device, allocated when first needed.
        self.allowed_token_ids_mask: torch.Tensor | None = None  # True = not allowed
        self.seen_token_mask: torch.Tensor | None = None  # prompt or output token, penalty rows
        self.output_token_counts: torch.Tensor | None = None
        self._counted = [0] * n  # output tokens already in output_token_counts, per row

    # ---- views -----------------------------------------------------------------------------
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Request id per row (after condense, exactly num_reqs entries)."""
        return self._req_ids  # type: ignore[return-value]

    def get_state(self, req_id: str) -> CachedRequestState:
        return self._states[self.req_id_to_index[req_id]]

    # ---- batch changes -----------------------------------------------------------------------
    def add_request(self, state: CachedRequestState) -> int:
        """Place a request in the lowest freed row (else at the end); returns its row."""
        if state.req_id in self.req_id_to_index:
            raise EngineInternalError(f"req_id {state.req_id!r} is already in the batch")
        builder = self.batch_update_builder
        if builder.moved:
            # A BatchUpdate applies adds before moves: an add into a row that condense
            # vacated this step would be moved away with it. vLLM's order: remove, add, condense.
            raise EngineInternalError("add_request after condense() moved rows this step; add first")
        row = builder.peek_removed()
        if row is not None and row < len(self._req_ids):
            builder.pop_removed()
        else:  # no hole, or only trailing ones that condense already cut off
            row = len(self._req_ids)
            builder.take_removed(row)
            if row >= self.max_num_reqs:
                raise EngineInternalError(f"batch is full: max_num_reqs={self.max_num_reqs}")
            self._req_ids.append(None)
            self._states.append(None)
        self._req_ids[row], self._states[row] = state.req_id, state
        self.req_id_to_index[state.req_id] = row
        builder.added.append((row, state.sampling_params, state.prompt_token_ids, state.output_token_ids))
        self._fill_row(row, state)
        return row

    def _fill_row(self, row: int, state: CachedRequestState) -> None:
        p, rid = state.sampling_params, state.req_id
        if p.greedy:
            self.greedy_reqs.add(rid)
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.top_p[row] = p.top_p
        if p.top_p < 1.0:
            self.top_p_reqs.add(rid)
        top_k = p.top_k if 0 < p.top_k < self.vocab_size else self.vocab_size
        self.top_k[row] = top_k
        if top_k < self.vocab_size:
            self.top_k_reqs.add(rid)
        self.frequency_penalties[row] = p.frequency_penalty
        self.presence_penalties[row] = p.presence_penalty
        self.repetition_penalties[row] = p.repetition_penalty
        if p.logprobs is not None:
            self.num_logprobs[rid] = p.logprobs
        _set(self.generators, row, state.generator)
        _set(self.bad_words_token_ids, row, p.bad_words_token_ids or None)
        if p.allowed_token_ids:
            mask = self._buffer("allowed_token_ids_mask", torch.bool)
            mask[row] = True
            mask[row, torch.tensor(p.allowed_token_ids, dtype=torch.long, device=self.device)] = False
            self.allowed_reqs.add(rid)
        elif self.allowed_token_ids_mask is not None:
            self.allowed_token_ids_mask[row] = False
        if _uses_penalties(p):
            self.penalty_reqs.add(rid)
            self._fill_penalty_row(row, state)

    def _fill_penalty_row(self, row: int, state: CachedRequestState) -> None:
        seen = self._buffer("seen_token_mask", torch.bool)
        counts = self._buffer("output_token_counts", torch.int32)
        out = state.output_token_ids
        seen[row] = False
        seen[row, torch.tensor(state.prompt_token_ids + out, dtype=torch.long, device=self.device)] = True
        counts[row] = 0
        if out:
            ones = torch.ones(len(out), dtype=torch.int32, device=self.device)
            counts[row].index_add_(0, torch.tensor(out, dtype=torch.long, device=self.device), ones)
        self._counted[row] = len(out)

    def _buffer(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, name)
        if buf is None:
            buf = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=dtype, device=self.device)
            setattr(self, name, buf)
        return buf

    def remove_request(self, req_id: str) -> int | None:
        """Free a request's row (None when it is not in the batch); condense fills holes."""
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        if not self.batch_update_builder.cancel_added(row):
            self.batch_update_builder.removed_append(row)
        self._req_ids[row] = self._states[row] = None
        for ids in (self.greedy_reqs, self.top_p_reqs, self.top_k_reqs, self.penalty_reqs,
                    self.allowed_reqs):
            ids.discard(req_id)
        self.num_logprobs.pop(req_id, None)
        self.generators.pop(row, None)
        self.bad_words_token_ids.pop(row, None)
        return row

    def condense(self) -> None:
        """Fill the holes left by removals: the highest live row moves to the lowest hole."""
        builder = self.batch_update_builder
        if not builder.has_removed():
            return
        num_reqs = self.num_reqs
        last = len(self._req_ids) - 1
        while builder.has_removed():
            while last >= 0 and self._req_ids[last] is None:
                last -= 1
            hole = builder.peek_removed()
            if hole >= last:
                break
            builder.pop_removed()
            self._move(last, hole)
            builder.moved.append((last, hole, MoveDirectionality.UNIDIRECTIONAL))
            last -= 1
        del self._req_ids[num_reqs:]
        del self._states[num_reqs:]

    def _move(self, src: int, dst: int) -> None:
        req_id, state = self._req_ids[src], self._states[src]
        self._req_ids[dst], self._states[dst] = req_id, state
        self._req_ids[src] = self._states[src] = None
        self.req_id_to_index[req_id] = dst
        for t in self._row_tensors:
            t[dst] = t[src]
        _set(self.generators, dst, self.generators.pop(src, None))
        _set(self.bad_words_token_ids, dst, self.bad_words_token_ids.pop(src, None))
        if self.allowed_token_ids_mask is not None:
            self.allowed_token_ids_mask[dst] = self.allowed_token_ids_mask[src]
        if req_id in self.penalty_reqs:
            self.seen_token_mask[dst] = self.seen_token_mask[src]
            self.output_token_counts[dst] = self.output_token_counts[src]
            self._counted[dst] = self._counted[src]

    # ---- the step ------------------------------------------------------------------------------
    def refresh(self) -> SamplingMetadata:
        """Close the step's batch changes: one BatchUpdate to every processor (even when None:
        output lists grew), then this step's SamplingMetadata."""
        self.condense()
        n = self.num_reqs
        batch_update = self.batch_update_builder.get_and_reset(n)
        for proc in self.logitsprocs.all:
            proc.update_state(batch_update)
        return self._make_metadata(n)

    def _penalty_rows(self) -> list[int]:
        rows = sorted(self.req_id_to_index[r] for r in self.penalty_reqs)
        new_rows, new_tokens = [], []
        for row in rows:  # count only the tokens sampled since the last step
            out, seen = self._states[row].output_token_ids, self._counted[row]
            if len(out) < seen:  # the output was rewritten: recount the row
                self._fill_penalty_row(row, self._states[row])
            elif len(out) > seen:
                new_rows.extend([row] * (len(out) - seen))
                new_tokens.extend(out[seen:])
                self._counted[row] = len(out)
        if new_rows:
            idx = (torch.tensor(new_rows, dtype=torch.long, device=self.device),
                   torch.tensor(new_tokens, dtype=torch.long, device=self.device))
            self.output_token_counts.index_put_(
                idx, torch.ones(len(new_rows), dtype=torch.int32, device=self.device), accumulate=True)
            self.seen_token_mask[idx] = True
        return rows

    def _make_metadata(self, n: int) -> SamplingMetadata:
        dev = self.device
        to_dev = (lambda t: t[:n]) if dev.type == "cpu" else (lambda t: t[:n].to(dev, non_blocking=True))
        all_greedy = len(self.greedy_reqs) == n
        meta = SamplingMetadata(
            temperature=None if all_greedy else to_dev(self.temperature),
            all_greedy=all_greedy,
            all_random=not self.greedy_reqs,
            top_p=to_dev(self.top_p) if self.top_p_reqs else None,
            top_k=to_dev(self.top_k) if self.top_k_reqs else None,
            generators=self.generators,
            max_num_logprobs=max(self.num_logprobs.values()) if self.num_logprobs else None,
            output_token_ids=[s.output_token_ids for s in self._states[:n]],
            allowed_token_ids_mask=(self.allowed_token_ids_mask[:n] if self.allowed_reqs else None),
            bad_words_token_ids=self.bad_words_token_ids,
            logitsprocs=self.logitsprocs,
        )
        if self.penalty_reqs:
            meta.penalty_rows = torch.tensor(self._penalty_rows(), dtype=torch.long, device=dev)
            meta.frequency_penalties = to_dev(self.frequency_penalties)
            meta.presence_penalties = to_dev(self.presence_penalties)
            meta.repetition_penalties = to_dev(self.repetition_penalties)
            meta.seen_token_mask = self.seen_token_mask
            meta.output_token_counts = self.output_token_counts
        return meta


def _set(d: dict, key: int, value) -> None:
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value
