"""Thinking budget: cap the tokens a request spends inside a reasoning block.

The engine's `reasoning_config={"reasoning_start_str": ..., "reasoning_end_str": ...}` gives
the start / end token sequences (either may be several tokens). For a request with
`thinking_token_budget=B`, tokens after the last start sequence are counted (prompt tokens
too, when the prompt ends inside a thinking block). Once B are counted, each following step
forces the next token of the end sequence; a natural end stops the count and a later start
sequence re-arms it. The state is a function of the token stream alone (the state machine is
`cluster.reasoning.ReasoningTracker`, shared with the grammar matchers), read from the live
output lists, so a discarded sample (a non-final prefill chunk) changes nothing. Under
speculative decoding each draft position gets the state after the drafts before it (a copy of
the row's tracker fed those drafts), so accepted drafts and the bonus token count exactly and
a forced end sequence carries on through a rejection into the next step.

It is a built-in logits processor, like vLLM's own, and not argmax invariant: it runs with
the other such processors, before the penalties. A forced row keeps one finite logit, which no
penalty can outrank (they scale or shift it, and leave -inf where it is).
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from cluster.reasoning import ReasoningMarkers, ReasoningTracker
from cluster.sample.logits_processor.builtin import process_dict_updates
from cluster.sample.logits_processor.interface import BatchUpdate, LogitsProcessor, SpecDecodeMetadata
from cluster.sampling_params import SamplingParams

# Forced rows keep only the forced token, at a large finite logit: finite so softmax and
# temperature stay NaN-free, alone so it wins under greedy, any temperature, top-k/p, min-p.
FORCED_LOGIT = 1.0e4


def validate_thinking_budget(params: SamplingParams, reasoning_config: dict[str, str] | None) -> None:
    """A budget (other than -1 / None, unlimited) needs the engine's reasoning config."""
    if not params.unlimited_thinking and not reasoning_config:
        raise ValueError(f"thinking_token_budget={params.thinking_token_budget} set without a "
                         "reasoning config: start the engine with reasoning_config="
                         "{'reasoning_start_str': ..., 'reasoning_end_str': ...}")


@dataclass
class _Row:
    tracker: ReasoningTracker
    output: list[int]  # the request's live output list
    seen: int  # output tokens already fed


class ThinkingBudget(LogitsProcessor):
    """Per-row reasoning state driven by the persistent batch's BatchUpdate.

    `update_state` runs every step (before `apply`): it feeds new output tokens and decides
    which rows are forced; `apply` then overwrites those rows in one batched op. Built by
    `build_logitsprocs` from `config.reasoning_token_ids` when the engine has a reasoning config.

    Rows with a budget are tracked (constrained rows as such: once a constrained row answers,
    no start sequence inside the answer re-arms the budget against its grammar).
    """

    def __init__(self, start_token_ids: Sequence[int], end_token_ids: Sequence[int],
                 device: torch.device | str = "cpu") -> None:
        if not start_token_ids or not end_token_ids:
            raise ValueError(f"thinking budget needs non-empty start and end token ids, got "
                             f"{list(start_token_ids)!r} and {list(end_token_ids)!r}")
        self.markers = ReasoningMarkers(tuple(start_token_ids), tuple(end_token_ids))
        self.start, self.end = self.markers.start, self.markers.end
        self.device = torch.device(device)
        self.trackers: dict[int, _Row] = {}
        self.forced: dict[int, int] = {}  # row -> token forced this step
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None

    def _new_tracker(self, params: SamplingParams, prompt: list[int] | None,
                     output: list[int]) -> _Row | None:
        if params.unlimited_thinking:
            return None
        tracker = self.markers.tracker(prompt or (), output, constrained=params.structured_outputs is not None,
                                       budget=params.thinking_token_budget)
        return _Row(tracker, output, len(output))

    # ---- the processor interface -----------------------------------------------------------
    def is_argmax_invariant(self) -> bool:
        return False

    @classmethod
    def supports_spec_decode(cls) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.trackers, batch_update, self._new_tracker)
        forced: dict[int, int] = {}
        for row, entry in self.trackers.items():
            out = entry.output
            while entry.seen < len(out):
                entry.tracker.feed(out[entry.seen])
                entry.seen += 1
            tok = entry.tracker.forced_token()
            if tok is not None:
                forced[row] = tok
        if forced != self.forced:
            self.forced = forced
            self._index = (torch.tensor(list(forced), dtype=torch.long, device=self.device),
                           torch.tensor(list(forced.values()), dtype=torch.long, device=self.device))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.forced:
            return logits
        return _force(logits, *self._index)

    def apply_with_spec_decode(self, logits: torch.Tensor, spec: SpecDecodeMetadata) -> torch.Tensor:
        rows, cols = [], []
        for row, entry in self.trackers.items():
            draft = spec.draft_token_ids[row]
            probe = dataclasses.replace(entry.tracker, tail=list(entry.tracker.tail)) if draft else entry.tracker
            for j, r in enumerate(spec.rows_of(row)):
                if j:
                    probe.feed(draft[j - 1])
                tok = probe.forced_token()
                if tok is not None:
                    rows.append(r)
                    cols.append(tok)
        if not rows:
            return logits
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=logits.device)  # noqa: E731
        return _force(logits, as_tensor(rows), as_tensor(cols))


def _force(logits: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    logits.index_fill_(0, rows, -math.inf)
    return logits.index_put_((rows, cols), torch.tensor(FORCED_LOGIT, dtype=logits.dtype, device=logits.device))
