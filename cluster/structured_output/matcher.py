"""Rank 0's grammar state: one xgrammar GrammarMatcher per constrained request.

Each step: `fill_bitmask` for the rows that sample, `apply` on the logits (before any
other processor), then `accept` every sampled token. A request's matcher is rebuilt from
its serialized grammar plus the outputs it already has, so a request resumed after
preemption (or re-sent to a new worker) continues from the same grammar state.

The grammar's stop token (the model's eos) stays masked until the grammar can end, and
once the matcher has accepted it the request is over: with `ignore_eos` the grammar, not
the eos check, decides the end (`is_terminated`).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Sequence

import torch
import xgrammar as xgr

from cluster.errors import EngineInternalError
from cluster.structured_output.compiler import tokenizer_info_for_config

logger = logging.getLogger(__name__)

# From this many rows on, xgrammar's BatchGrammarMatcher fills rows on its own threads
# (one C++ call, no per-row Python); a handful of rows are cheaper in a plain loop.
_BATCH_FILL_MIN_ROWS = 8
_GRAMMAR_CACHE_SIZE = 32
# A row takes the sparse path when at most 1/4 of its bitmask words are non-zero: past
# that, gathering the allowed ids costs more than xgrammar's kernel (measured).
_SPARSE_WORD_FRACTION = 4
_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


class StructuredOutputManager:
    def __init__(self, tokenizer_info: xgr.TokenizerInfo, max_num_seqs: int = 64,
                 num_threads: int | None = None) -> None:
        self.tokenizer_info = tokenizer_info
        self.vocab_size = tokenizer_info.vocab_size
        self.matchers: dict[str, xgr.GrammarMatcher] = {}
        self._compiled: OrderedDict[str, xgr.CompiledGrammar] = OrderedDict()
        self._bitmask = xgr.allocate_token_bitmask(max(1, max_num_seqs), self.vocab_size)
        self._batch = xgr.BatchGrammarMatcher(num_threads or max(1, torch.get_num_threads()))
        self._stop_row = _only_tokens(tokenizer_info.stop_token_ids, self._bitmask.shape[1])
        self._filled_rows: list[int] = []

    @classmethod
    def for_model(cls, config: Any) -> "StructuredOutputManager":
        """From a finalized EngineConfig; shares the process-wide TokenizerInfo cache with the
        compile service (same tokenizer path, vocab size and stop ids)."""
        return cls(tokenizer_info_for_config(config), config.scheduler_config.max_num_seqs)

    # ---- per-request state ------------------------------------------------------------------
    def has(self, req_id: str) -> bool:
        return req_id in self.matchers

    def add(self, req_id: str, grammar_json: str, output_token_ids: Sequence[int] = ()) -> None:
        """(Re)build the matcher and replay the outputs the request already produced."""
        matcher = xgr.GrammarMatcher(self._deserialize(grammar_json))
        for i, tok in enumerate(output_token_ids):
            if not matcher.accept_token(int(tok)):
                raise EngineInternalError(f"output_token_ids[{i}]={tok} of request {req_id!r} does not "
                                 "follow its grammar; cannot restore the grammar state")
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)

    def accept(self, req_id: str, token_id: int) -> bool:
        """Advance the grammar; False when the token is not allowed (state unchanged)."""
        ok = self.matchers[req_id].accept_token(int(token_id))
        if not ok:
            # Only reachable when something after the bitmask forced a masked token.
            logger.warning("request %s: token %d rejected by its grammar", req_id, token_id)
        return ok

    def is_terminated(self, req_id: str) -> bool:
        return self.matchers[req_id].is_terminated()

    # ---- the bitmask ------------------------------------------------------------------------
    def fill_bitmask(self, rows: Sequence[tuple[int, str]], batch_size: int) -> torch.Tensor | None:
        """int32 [batch_size, ceil(vocab/32)] (1 = allowed) for (row index, request id) pairs;
        other rows stay all-ones. None when no row is constrained. The tensor is a view of a
        reused buffer: valid until the next call."""
        if not rows:
            self._filled_rows = []
            return None
        if batch_size > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(batch_size, self.vocab_size)
        mask = self._bitmask[:batch_size]
        mask.fill_(-1)
        live_idx, live = [], []
        for i, rid in rows:
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
        self._filled_rows = [i for i, _ in rows]
        return mask

    def fill_bitmask_with_drafts(self, rows: Sequence[tuple[int, str, Sequence[int]]],
                                 num_rows: int) -> torch.Tensor | None:
        """Speculative steps: for (first logits row, request id, draft tokens) entries, row
        first + j gets the mask after the request's drafts 0..j-1. The matcher walks the
        drafts and is rolled back to where it was, so only tokens the engine later reports
        accepted advance it. Positions past a draft the grammar refuses are left all-ones:
        that draft is masked where it is proposed, so it is rejected and they are discarded."""
        if not rows:
            self._filled_rows = []
            return None
        if num_rows > self._bitmask.shape[0]:
            self._bitmask = xgr.allocate_token_bitmask(num_rows, self.vocab_size)
        mask = self._bitmask[:num_rows]
        mask.fill_(-1)
        filled = []
        for first, rid, draft in rows:
            m = self.matchers[rid]
            walked = 0
            for j in range(len(draft) + 1):
                if m.is_terminated():
                    mask[first + j] = self._stop_row
                else:
                    m.fill_next_token_bitmask(mask, first + j)
                filled.append(first + j)
                if j == len(draft) or not m.accept_token(int(draft[j])):
                    break
                walked += 1
            if walked:
                m.rollback(walked)
        self._filled_rows = filled
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
        compiled = self._compiled.get(grammar_json)
        if compiled is None:
            compiled = xgr.CompiledGrammar.deserialize_json(grammar_json, self.tokenizer_info)
            self._compiled[grammar_json] = compiled
            if len(self._compiled) > _GRAMMAR_CACHE_SIZE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(grammar_json)
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


def _only_tokens(token_ids: Sequence[int], words: int) -> torch.Tensor:
    row = torch.zeros(words, dtype=torch.int64)
    for t in token_ids:
        row[t // 32] |= 1 << (t % 32)
    # Bit 31 set means a negative int32: wrap through int64 explicitly.
    return torch.where(row >= 2**31, row - 2**32, row).to(torch.int32)
