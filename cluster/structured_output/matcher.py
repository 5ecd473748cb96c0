"""Rank 0's grammar state: one xgrammar GrammarMatcher per constrained request.

Each step: `fill_bitmask` for the rows that sample, `apply` on the logits (before any
other processor), then `accept_emitted` with the step's sampled tokens. A request's
matcher is rebuilt from its serialized grammar plus the outputs it already has, so a request
resumed after preemption (or re-sent to a new worker) continues from the same grammar state.

The grammar's stop token (the model's eos) stays masked until the grammar can end, and
once the matcher has accepted it the request is over: with `ignore_eos` the grammar, not
the eos check, decides the end (the matcher's `is_terminated`).

With reasoning markers (the engine's reasoning config) a matcher sees only the answer: a
per-request `ReasoningTracker` (the state machine the thinking budget uses too) routes each
token, and the grammar's mask starts after the end sequence. While the request thinks its row
is free (only eos is banned under `ignore_eos`: the scheduler ends a grammar request on eos).
A constrained request whose prompt holds no marker may still choose to think when the start
marker is a single token: its first position allows the grammar's tokens plus that token.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch
import xgrammar as xgr

from cluster.errors import EngineInternalError
from cluster.reasoning import Phase, ReasoningMarkers, ReasoningTracker
from cluster.structured_output.compiler import release_free_heap, tokenizer_info_for_config

logger = logging.getLogger(__name__)

# From this many rows on, xgrammar's BatchGrammarMatcher fills rows on its own threads
# (one C++ call, no per-row Python); a handful of rows are cheaper in a plain loop.
_BATCH_FILL_MIN_ROWS = 8
# Deserialized grammars kept for repeats, by bytes. A grammar's size is counted as 3x its JSON:
# measured, a deserialized grammar took 1.8-2.8x its JSON in RSS (25-34 MB for a schema with a
# 2000-character maxLength), while xgrammar's `memory_size_bytes` said 2.25 MB. Counted by
# entries (32), the soak's schemas held the TP worker 1.2 GB above its start; by
# `memory_size_bytes`, growing past 3 GB.
_GRAMMAR_CACHE_BYTES = 256 << 20
# A row takes the sparse path when at most 1/4 of its bitmask words are non-zero: past
# that, gathering the allowed ids costs more than xgrammar's kernel (measured).
_SPARSE_WORD_FRACTION = 4
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class StructuredOutputManager:
    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_num_seqs: int = 64,
                 num_threads: int | None = None, reasoning: ReasoningMarkers | None = None) -> None:
        self.tokenizer_info = tokenizer_info
        self.reasoning = reasoning
        # Requests whose answer has not begun; gone once it has (or without markers).
        self.gates: dict[str, ReasoningTracker] = {}
        self.ban_eos_while_thinking: set[str] = set()
        self.vocab_size = tokenizer_info.vocab_size
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        # blake2b of the serialized grammar -> (grammar, its size); the key is not the string
        # itself, which can be megabytes.
        self._compiled: OrderedDict[bytes, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._compiled_bytes = 0
        self._bitmask = xgr.allocate_token_bitmask(max(1, max_num_seqs), self.vocab_size)
        self._batch = xgr.BatchGrammarMatcher(num_threads or max(1, torch.get_num_threads()))
        self._stop_row = _only_tokens(tokenizer_info.stop_token_ids, self._bitmask.shape[1])
        self._filled_rows: list[int] = []

    @classmethod
    def for_model(cls, config: Any) -> "StructuredOutputManager":
        """From a finalized EngineConfig; shares the process-wide TokenizerInfo cache with the
        compile service (same tokenizer path, vocab size and stop ids)."""
        return cls(tokenizer_info_for_config(config), config.scheduler_config.max_num_seqs,
                   reasoning=ReasoningMarkers.from_config(config))

    # ---- per-request state ------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        return req_id in self.matchers

    def add(self, req_id: str, grammar_json: str, output_token_ids: Sequence[int] = (),
            prompt_token_ids: Sequence[int] | None = None, ignore_eos: bool = False) -> None:
        """(Re)build the matcher and replay the outputs the request already produced. With
        reasoning markers and the prompt, only the answer's tokens reach the matcher."""
        answer = output_token_ids
        if self.reasoning is not None and prompt_token_ids is not None:
            gate = self.reasoning.tracker(prompt_token_ids, constrained=True)
            answer = [t for t in output_token_ids if gate.feed(t)]
            if gate.phase is not Phase.ANSWER:
                self.gates[req_id] = gate
                if ignore_eos:
                    self.ban_eos_while_thinking.add(req_id)
        matcher = xgr.GrammarMatcher(self._deserialize(grammar_json))
        for i, tok in enumerate(answer):
            if not matcher.accept_token(int(tok)):
                raise EngineInternalError(f"output_token_ids[{i}]={tok} of request {req_id!r} does not "
                                 "follow its grammar; cannot restore the grammar state")
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.gates.pop(req_id, None)
        self.ban_eos_while_thinking.discard(req_id)

    def accept(self, req_id: str, token_id: int) -> bool:
        """Advance the grammar (a thinking token only moves the reasoning state); False when
        the token is not allowed (state unchanged)."""
        gate = self.gates.get(req_id)
        if gate is not None:
            answer = gate.feed(token_id)
            if gate.phase is Phase.ANSWER:  # the end sequence closed, or the answer began here
                del self.gates[req_id]
                self.ban_eos_while_thinking.discard(req_id)
            if not answer:
                return True
        ok = self.matchers[req_id].accept_token(int(token_id))
        if not ok:
            # Only reachable when something after the bitmask forced a masked token.
            logger.warning("request %s: token %d rejected by its grammar", req_id, token_id)
        return ok

    def accept_emitted(self, req_ids: Sequence[str], emitted: Sequence[Sequence[int]]) -> None:
        """A step's emitted tokens, per request, into the constrained requests' matchers. A
        matcher that has ended takes nothing: its request is over, and async scheduling may
        have run it one step more before the engine saw the end."""
        for req_id, tokens in zip(req_ids, emitted):
            if req_id in self.matchers:
                for token in tokens:
                    if self.matchers[req_id].is_terminated():
                        break
                    self.accept(req_id, token)

    # ---- the bitmask ------------------------------------------------------------------------
    def fill_bitmask(self, rows: Sequence[tuple[int, str]], batch_size: int) -> torch.Tensor | None:
        """int32 [batch_size, ceil(vocab/32)] (1 = allowed) for (row index, request id) pairs;
        other rows stay all-ones. None when no row is constrained. The tensor is a view of a
        reused buffer: valid until the next call."""
        if not rows:
            self._filled_rows = []
            return None
        mask = self._cleared_mask(batch_size)
        live_idx, live, filled, allow_start = [], [], [], []
        for i, rid in rows:
            gate = self.gates.get(rid)
            thinking = self._thinking_row(mask, i, rid, gate)
            if thinking is not None:
                if thinking:
                    filled.append(i)
                continue
            if gate is not None:
                allow_start.append(i)
            filled.append(i)
            m = self.matchers[rid]
            if m.is_terminated():  # finished grammar: nothing but the stop token again
                mask[i] = self._stop_row
            else:
                live_idx.append(i)
                live.append(m)
        if len(live) >= _BATCH_FILL_MIN_ROWS:
            self._batch.batch_fill_next_token_bitmask(live, mask, live_idx)
        else:
            for i, m in zip(live_idx, live):
                m.fill_next_token_bitmask(mask, i)
        for i in allow_start:
            _set_bit(mask, i, self.reasoning.start[0], True)
        self._filled_rows = filled
        return mask

    def fill_bitmask_with_drafts(self, rows: Sequence[tuple[int, str, Sequence[int]]],
                                 num_rows: int) -> torch.Tensor | None:
        """Speculative steps: for (first logits row, request id, draft tokens) entries, row
        first + j gets the mask after the request's drafts 0..j-1. The matcher walks the
        drafts (through a copy of the reasoning gate: thinking drafts only move the copy) and
        is rolled back to where it was, so only the tokens the step emits advance it
        (`accept_emitted`). Positions past a draft the grammar refuses are left all-ones: that
        draft is masked where it is proposed, so it is rejected and they are discarded."""
        if not rows:
            self._filled_rows = []
            return None
        mask = self._cleared_mask(num_rows)
        filled: list[int] = []
        for first, rid, draft in rows:
            m, gate = self.matchers[rid], self.gates.get(rid)
            if gate is not None and draft:
                gate = dataclasses.replace(gate, tail=list(gate.tail))
            walked = 0
            for j in range(len(draft) + 1):
                if self._fill_row(mask, first + j, rid, m, gate):
                    filled.append(first + j)
                if j == len(draft):
                    break
                tok = int(draft[j])
                answer = True
                if gate is not None:
                    answer = gate.feed(tok)
                    if gate.phase is Phase.ANSWER:
                        gate = None
                if answer:
                    if not m.accept_token(tok):
                        break
                    walked += 1
            if walked:
                m.rollback(walked)
        self._filled_rows = filled
        return mask

    def _fill_row(self, mask: torch.Tensor, i: int, rid: str, m: xgr.GrammarMatcher,
                  gate: ReasoningTracker | None) -> bool:
        """One row's mask in `fill_bitmask`'s terms, with `gate` as the reasoning state; True
        when the row was written."""
        thinking = self._thinking_row(mask, i, rid, gate)
        if thinking is not None:
            return thinking
        if m.is_terminated():
            mask[i] = self._stop_row
        else:
            m.fill_next_token_bitmask(mask, i)
        if gate is not None:
            _set_bit(mask, i, self.reasoning.start[0], True)
        return True

    def _thinking_row(self, mask: torch.Tensor, i: int, rid: str, gate: ReasoningTracker | None) -> bool | None:
        """None when the grammar decides row i; else the request is thinking and the row is
        free (only eos banned under `ignore_eos`): whether the row was written."""
        if gate is None or gate.phase is Phase.OPEN:
            return None
        if rid not in self.ban_eos_while_thinking:
            return False
        for t in self.tokenizer_info.stop_token_ids:
            _set_bit(mask, i, t, False)
        return True

    def _cleared_mask(self, num_rows: int) -> torch.Tensor:
        """All-ones rows [num_rows] of the reused bitmask buffer (grown when too small)."""
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        mask = self._bitmask[:num_rows]
        mask.fill_(-1)
        return mask

    def apply(self, logits: torch.Tensor, bitmask: torch.Tensor | None,
              rows: Sequence[int] | None = None) -> None:
        """Masked logits -> -inf, in place, on the rows of the last fill (or `rows`); other
        rows keep their exact bits. Logits may be fp32/bf16/fp16 and as wide as the model vocab."""
        if bitmask is None:
            return
        rows = sorted(self._filled_rows if rows is None else rows)
        if not rows:
            return
        if bitmask.device != logits.device:
            bitmask = bitmask.to(logits.device, non_blocking=True)
        width = logits.shape[-1]
        n = min(width, self.vocab_size)
        kernel_rows = rows
        if logits.device.type == "cpu":  # rows allowing few tokens are cheaper rebuilt than masked
            words = bitmask.shape[1]
            nonzero = (bitmask[rows] != 0).sum(1).tolist()
            sparse = [r for r, nz in zip(rows, nonzero) if nz * _SPARSE_WORD_FRACTION <= words]
            kernel_rows = [r for r, nz in zip(rows, nonzero) if nz * _SPARSE_WORD_FRACTION > words]
            if sparse:
                _apply_sparse(logits, bitmask, sparse, n)
        if kernel_rows:
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=n, indices=kernel_rows)
        if width > self.vocab_size:  # padded logits: ids past the grammar's vocab are never valid
            logits[rows, self.vocab_size:] = float("-inf")

    def _deserialize(self, grammar_json: str) -> xgr.CompiledGrammar:
        # n > 1 children and repeated schemas share one deserialized grammar.
        key = hashlib.blake2b(grammar_json.encode(), digest_size=16).digest()
        hit = self._compiled.get(key)
        if hit is not None:
            self._compiled.move_to_end(key)
            return hit[0]
        compiled = xgr.CompiledGrammar.deserialize_json(grammar_json, self.tokenizer_info)
        size = 3 * len(grammar_json)
        self._compiled[key] = (compiled, size)
        self._compiled_bytes += size
        evicted = False
        while self._compiled_bytes > _GRAMMAR_CACHE_BYTES and len(self._compiled) > 1:
            self._compiled_bytes -= self._compiled.popitem(last=False)[1][1]
            evicted = True
        if evicted:  # tens of MB freed on this thread's heap: give them back (a few ms)
            release_free_heap()
        return compiled



def _apply_sparse(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int], vocab_size: int) -> None:
    """Save the few allowed logits, fill the rows with -inf, put them back. xgrammar's CPU
    kernel writes masked tokens one bit at a time (~6 ms for 32 fully-masked rows of 49152),
    while a row fill runs at memset speed: ~0.6 ms for the same rows."""
    rows_t = torch.tensor(rows, dtype=torch.long)
    sub = bitmask[rows_t]
    r, w = (sub != 0).nonzero(as_tuple=True)
    bits = (sub[r, w].unsqueeze(1) >> _BIT_SHIFTS) & 1  # arithmetic shift: bit 31 reads as 1 too
    j, b = bits.nonzero(as_tuple=True)
    row, tok = rows_t[r[j]], w[j] * 32 + b
    keep = tok < vocab_size
    row, tok = row[keep], tok[keep]
    vals = logits[row, tok]
    logits.index_fill_(0, rows_t, float("-inf"))
    logits[row, tok] = vals


def _set_bit(mask: torch.Tensor, row: int, token: int, allowed: bool) -> None:
    bit = 1 << (token % 32)
    bit = bit - 2**32 if bit >= 2**31 else bit  # int32 words: bit 31 is the sign
    if allowed:
        mask[row, token // 32] |= bit
    else:
        mask[row, token // 32] &= ~bit


def _only_tokens(token_ids: Sequence[int], words: int) -> torch.Tensor:
    row = torch.zeros(words, dtype=torch.int64)
    for t in token_ids:
        row[t // 32] |= 1 << (t % 32)
    # Bit 31 set means a negative int32: wrap through int64 explicitly.
    return torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)
