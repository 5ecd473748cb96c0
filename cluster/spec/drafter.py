"""The engine's side of speculative decoding: which requests draft this step, and how well
their drafts do.

The rule: in a step with B decoding requests, a request drafts only while its acceptance
rate (an exponential average of accepted / drafted tokens over its recent drafts) is at least
`acceptance_threshold(B)`, the rate at which drafts pay for their verification. It grows with
B: a bigger batch already fills the forward with useful tokens, so past some size no request
drafts at all (the step does not speculate), and at any size a request whose drafts keep
failing stops. While a request does not draft, the proposer still runs and its draft is
compared with the tokens the request then produces (a "shadow" draft), so the estimate keeps
moving and a request whose text turns copy-heavy drafts again. With one-hot n-gram drafts
the verifier accepts a draft token exactly when it equals the token the model emits, so a
shadow draft measures what a real one would. A new request's estimate starts at what recent
drafts of all requests achieved: where most text is free-form, new requests do not each spend
their first drafts proving they should not draft.

Where the threshold comes from: decode-only steps cost about t0 + t_dec * B + t_draft * D
(D draft tokens). k drafts accepted at rate a add a * k tokens for t_draft * k seconds, which
raises the step's tokens/s when a > t_draft / (time per token of the plain step), i.e.
a > t_draft * B / (t0 + t_dec * B). `benchmarks/spec.py --calibrate` fits t0, t_dec and t_draft
(docs/speculative_decoding.md has the measurement); `speculative_config` can replace the
threshold (`min_acceptance_rate`) or cap the batch outright (`disable_by_batch_size`).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.config import SpeculativeConfig
from cluster.spec.ngram import NgramIndex, NgramProposer

# Weight of the newest draft in a request's acceptance average: about the last 4 drafts count.
_EMA_WEIGHT = 0.25
# Weight of the newest draft, real or shadow, in the engine's average over every request's
# drafts (where a new request's estimate starts): about the last 20 count.
_POPULATION_WEIGHT = 0.05
# t_dec / t0 and t_draft / t0 of the step cost model (SmolLM2-135M, bf16, 2 CPU threads).
DECODE_COST = 0.022
DRAFT_COST = 0.027


def acceptance_threshold(num_decoding: int) -> float:
    """The acceptance rate above which a request's drafts raise a step's tokens/s."""
    return DRAFT_COST * num_decoding / (1.0 + DECODE_COST * num_decoding)


@dataclass(slots=True)
class _RequestState:
    index: NgramIndex = field(default_factory=NgramIndex)
    rate: float = 1.0  # a new request's: the engine's recent average (Drafter.population_rate)
    shadow_at: int = 0  # stream position the pending shadow draft predicts from
    shadow: list[int] = field(default_factory=list)


class Drafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.max_batch = config.disable_by_batch_size
        self.fixed_threshold = config.min_acceptance_rate
        # Optimistic before any draft: the first requests draft at once.
        self.population_rate = 1.0
        self.states: dict[str, _RequestState] = {}
        # Counters since start (EngineStats): verified drafts, their tokens, accepted tokens.
        self.reset_stats()

    def step_threshold(self, num_decoding: int) -> float | None:
        """The acceptance rate a request needs to draft in a step with this many decoding
        requests; None when nobody drafts (past disable_by_batch_size)."""
        if self.max_batch is not None and num_decoding > self.max_batch:
            return None
        if self.fixed_threshold is not None:
            return self.fixed_threshold
        return acceptance_threshold(num_decoding)

    def propose(self, req_id: str, tokens: Sequence[int], max_len: int, threshold: float | None) -> list[int]:
        """Draft up to min(max_len, num_speculative_tokens) tokens to follow `tokens` (the
        request's prompt + output); [] when the request should not draft now (its acceptance
        rate is below `threshold`, or threshold is None). Call once per step for every
        decoding request, drafting or not: it also scores shadow drafts."""
        st = self.states.get(req_id)
        if st is None:
            st = self.states[req_id] = _RequestState(rate=self.population_rate)
        self._score_shadow(st, tokens)
        k = min(max_len, self.num_speculative_tokens)
        if k < 1:
            return []
        draft = self.proposer.propose(st.index, tokens, k)
        if not draft:
            return []
        if threshold is not None and st.rate >= threshold:
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

    def reset_stats(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0

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

    def _update_rate(self, st: _RequestState, rate: float) -> None:
        st.rate += _EMA_WEIGHT * (rate - st.rate)
        self.population_rate += _POPULATION_WEIGHT * (rate - self.population_rate)
