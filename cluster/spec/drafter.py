"""The engine's side of speculative decoding: which requests draft this step, and how well
their drafts do.

Two rules keep speculation from costing more than it saves (docs/speculative_decoding.md
has the measurements behind the defaults):
- per step: while more than `disable_by_batch_size` requests are decoding, nobody drafts. A
  bigger batch already fills the forward with useful tokens, and each verified draft token
  costs about as much as a decode token there.
- per request: a request drafts only while its acceptance rate (an exponential average of
  accepted / drafted tokens over its recent drafts) is at least `min_acceptance_rate`. While
  it does not draft, the proposer still runs and its draft is compared with the tokens the
  request then produces (a "shadow" draft), so the estimate keeps moving: a request whose
  text turns copy-heavy drafts again. With one-hot n-gram drafts the verifier accepts a
  draft token exactly when it equals the token the model emits, so a shadow draft measures
  the same thing a real one would.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.config import SpeculativeConfig
from cluster.spec.ngram import NgramIndex, NgramProposer

# Weight of the newest draft in a request's acceptance average: about the last 4 drafts count.
_EMA_WEIGHT = 0.25


@dataclass(slots=True)
class _RequestState:
    index: NgramIndex = field(default_factory=NgramIndex)
    rate: float = 1.0  # optimistic: a new request drafts until its drafts prove poor
    shadow_at: int = 0  # stream position the pending shadow draft predicts from
    shadow: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.max_batch = config.disable_by_batch_size
        self.min_rate = config.min_acceptance_rate
        self.states: dict[str, _RequestState] = {}
        # Counters since start (EngineStats): verified drafts, their tokens, accepted tokens.
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

    def step_enabled(self, num_decoding: int) -> bool:
        """The per-step rule: speculate only while the decoding batch is small enough."""
        return num_decoding <= self.max_batch

    def propose(self, req_id: str, tokens: Sequence[int], max_len: int, enabled: bool) -> list[int]:
        """Draft up to min(max_len, num_speculative_tokens) tokens to follow `tokens` (the
        request's prompt + output); [] when the request should not draft now. Call once per
        step for every decoding request, drafting or not: it also scores shadow drafts."""
        st = self.states.get(req_id)
        if st is None:
            st = self.states[req_id] = _RequestState()
        self._score_shadow(st, tokens)
        k = min(max_len, self.num_speculative_tokens)
        if k < 1:
            return []
        draft = self.proposer.propose(st.index, tokens, k)
        if not draft:
            return []
        if enabled and st.rate >= self.min_rate:
            return draft
        if not st.shadow:
            st.shadow_at, st.shadow = len(tokens), draft
        return []

    def record(self, req_id: str, num_drafted: int, num_accepted: int) -> None:
        """A verified draft: how many of its tokens the model accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        st = self.states.get(req_id)
        if st is not None:
            self._update_rate(st, num_accepted / num_drafted)
            st.shadow = []  # superseded by a real measurement

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)

    def acceptance_rate(self, req_id: str) -> float | None:
        st = self.states.get(req_id)
        return None if st is None else st.rate

    def _score_shadow(self, st: _RequestState, tokens: Sequence[int]) -> None:
        if not st.shadow:
            return
        actual = tokens[st.shadow_at: st.shadow_at + len(st.shadow)]
        matched = 0
        for a, d in zip(actual, st.shadow):
            if a != d:
                break
            matched += 1
        if matched < len(actual) or len(actual) == len(st.shadow):  # decided
            self._update_rate(st, matched / len(st.shadow))
            st.shadow = []

    @staticmethod
    def _update_rate(st: _RequestState, rate: float) -> None:
        st.rate += _EMA_WEIGHT * (rate - st.rate)
