"""Thinking budget: validation, the counting / forcing state machine at the logits level,
and its state following persistent-batch moves (checked against an independent reference)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from cluster.sample import (Sampler, ThinkingBudget, check_reasoning_config, reasoning_token_ids,
                            validate_thinking_budget)
from cluster.sample.logits_processor import LogitsProcessors
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import CachedRequestState, InputBatch

VOCAB = 1000
START, END = [10, 11], [12, 13]  # multi-token sequences on purpose
CONFIG = {"reasoning_start_str": "<think>", "reasoning_end_str": "</think>"}


# ---- validation ---------------------------------------------------------------------------------------
def test_validate_thinking_budget():
    with pytest.raises(ValueError, match="set without a reasoning config"):
        validate_thinking_budget(SamplingParams(thinking_token_budget=8), None)
    with pytest.raises(ValueError, match="set without a reasoning config"):
        validate_thinking_budget(SamplingParams(thinking_token_budget=0), {})
    for budget in (None, -1):
        validate_thinking_budget(SamplingParams(thinking_token_budget=budget), None)
    validate_thinking_budget(SamplingParams(thinking_token_budget=8), CONFIG)


def test_reasoning_config_checks_and_tokenization():
    check_reasoning_config(None)
    check_reasoning_config(CONFIG)
    with pytest.raises(ValueError, match="reasoning_end_str"):
        check_reasoning_config({"reasoning_start_str": "<think>"})
    with pytest.raises(ValueError, match="unknown keys"):
        check_reasoning_config({**CONFIG, "extra": "x"})
    vocab = {"<think>": [10, 11], "</think>": [12, 13], "": []}
    assert reasoning_token_ids(CONFIG, vocab.__getitem__) == (START, END)
    assert reasoning_token_ids(None, vocab.__getitem__) is None
    with pytest.raises(ValueError, match="tokenizes to nothing"):
        reasoning_token_ids({"reasoning_start_str": "<think>", "reasoning_end_str": "x"},
                            lambda s: vocab.get(s, []))
    tb = ThinkingBudget(*reasoning_token_ids(CONFIG, vocab.__getitem__))
    assert tb.start == tuple(START) and tb.end == tuple(END)
    with pytest.raises(ValueError, match="non-empty"):
        ThinkingBudget([], [1])


# ---- the state machine, scripted ---------------------------------------------------------------------
class Script:
    """One request in a batch with a thinking budget; `step(tok)` appends a sampled token."""

    def __init__(self, budget: int | None, prompt: list[int], others: int = 2) -> None:
        self.budget = ThinkingBudget(START, END)
        self.batch = InputBatch(8, VOCAB, "cpu", LogitsProcessors([self.budget]))
        for i in range(others):  # neighbours without a budget must stay untouched
            self.batch.add_request(CachedRequestState(f"o{i}", [10, 11], SamplingParams(), [], [], 0, None))
        params = SamplingParams(thinking_token_budget=budget)
        self.state = CachedRequestState("r", prompt, params, [], [], 0, None)
        self.row = self.batch.add_request(self.state)

    def forced(self) -> int | None:
        """Refresh, apply to random logits, return the forced token of our row (None if free)."""
        self.batch.refresh()
        n = self.batch.num_reqs
        logits = torch.randn(n, VOCAB)
        out = self.budget.apply(logits.clone())
        row = self.batch.req_id_to_index["r"]
        for other in range(n):
            if other != row:
                assert torch.equal(out[other], logits[other])
        if torch.equal(out[row], logits[row]):
            return None
        finite = torch.isfinite(out[row]).nonzero().flatten().tolist()
        assert len(finite) == 1
        return finite[0]

    def run(self, tokens: list[int | None]) -> list[int | None]:
        """Feed tokens (None = emit whatever is forced, which must exist); returns the forced
        token seen before each step."""
        seen = []
        for tok in tokens:
            forced = self.forced()
            seen.append(forced)
            if tok is None:
                assert forced is not None
                tok = forced
            self.state.output_token_ids.append(tok)
        return seen


def test_exact_budget_from_inside_a_prompt_think_block():
    # Two tokens already thought in the prompt; budget 5 leaves 3 free outputs.
    s = Script(5, prompt=[1, 2, 10, 11, 20, 21])
    seen = s.run([30, 31, 32, None, None, 40, 41, 42])
    assert seen == [None, None, None, 12, 13, None, None, None]


def test_budget_counts_from_a_start_in_the_output():
    s = Script(3, prompt=[1, 2, 3])
    seen = s.run([50, 10, 11, 60, 61, 62, None, None, 70])
    assert seen == [None] * 6 + [12, 13, None]


def test_natural_end_stops_counting_and_a_new_start_re_arms():
    s = Script(4, prompt=[10, 11])
    seen = s.run([20, 21, 12, 13] + [30] * 6 + [10, 11, 40, 41, 42, 43, None, None, 50])
    assert seen == [None] * 16 + [12, 13, None]


def test_budget_reached_midway_through_a_natural_end_finishes_it():
    s = Script(3, prompt=[10, 11])
    seen = s.run([20, 21, 12, None, 30])  # the third thought token is the end's first token
    assert seen == [None, None, None, 13, None]


def test_zero_budget_and_start_inside_think_re_arms():
    s = Script(0, prompt=[5, 10, 11])
    assert s.run([None, None, 7]) == [12, 13, None]
    s = Script(3, prompt=[10, 11, 20])
    # A start sequence while thinking resets the count (without it, step 2 would be forced).
    assert s.run([10, 11, 21, 22, 23, None, None]) == [None] * 5 + [12, 13]


@pytest.mark.parametrize("budget", [None, -1])
def test_unlimited_and_no_thinking_are_never_forced(budget):
    s = Script(budget, prompt=[10, 11])
    assert s.run([20] * 10) == [None] * 10
    s = Script(2, prompt=[1, 2])
    assert s.run([20] * 10 + [12, 13]) == [None] * 12


def test_forced_token_wins_under_any_sampling():
    params = [SamplingParams(thinking_token_budget=0, temperature=t, top_p=tp, top_k=k, min_p=mp,
                             logit_bias={500: 80.0}, presence_penalty=2.0, logprobs=1, seed=i)
              for i, (t, tp, k, mp) in enumerate([(0.0, 1.0, 0, 0.0), (5.0, 0.3, 0, 0.0),
                                                   (1.0, 1.0, 3, 0.9), (0.01, 0.5, 10, 0.5)])]
    batch = InputBatch(4, VOCAB, "cpu", LogitsProcessors([ThinkingBudget(START, END)]))
    for i, p in enumerate(params):
        gen = None if p.greedy else torch.Generator().manual_seed(i)
        batch.add_request(CachedRequestState(f"r{i}", [10, 11], p, [12 if i == 3 else 500], [], 0, gen))
    out = Sampler()(torch.randn(4, VOCAB) * 5, batch.refresh())
    # Output [500] is one thought token: force END[0]; row 3 already emitted END[0]: END[1].
    assert out.sampled_token_ids.tolist() == [12, 12, 12, 13]
    assert out.logprobs[:, 0].tolist() == [0.0] * 4 and out.sampled_ranks.tolist() == [1] * 4


# ---- fuzz against an independent reference ------------------------------------------------------------
def reference_forced(stream: list[int], budget: int) -> int | None:
    """From the whole token stream: inside an unfinished think block with >= budget tokens
    after its start, the next end-sequence token is due."""
    s, e = START, END
    last = next((i + len(s) for i in range(len(stream) - len(s), -1, -1) if stream[i:i + len(s)] == s), -1)
    if last < 0:
        return None
    after = stream[last:]
    if any(after[i:i + len(e)] == e for i in range(len(after) - len(e) + 1)) or len(after) < budget:
        return None
    for k in range(min(len(e) - 1, len(after)), 0, -1):
        if after[-k:] == e[:k]:
            return e[k]
    return e[0]


def test_budget_state_follows_the_persistent_batch_fuzz():
    rng = random.Random(0)
    torch.manual_seed(0)
    tb = ThinkingBudget(START, END)
    batch = InputBatch(32, VOCAB, "cpu", LogitsProcessors([tb]))
    live: dict[str, CachedRequestState] = {}
    parked: list[CachedRequestState] = []
    small = [10, 11, 12, 13, 20, 21, 22, 23]  # the "model" speaks a tiny language, S/E often
    made = forced_steps = 0
    for step in range(80):
        for rid in rng.sample(sorted(live), k=rng.randint(0, min(3, len(live)))):
            batch.remove_request(rid)
            if rng.random() < 0.5:
                parked.append(live[rid])
            del live[rid]
        for _ in range(rng.randint(0, 4)):
            if len(live) == 32:
                break
            if parked and rng.random() < 0.4:
                s = parked.pop(0)
            else:
                budget = rng.choice([None, -1, 0, 1, 3, 6])
                prompt = [rng.choice(small + [1, 2]) for _ in range(rng.randint(1, 8))]
                s = CachedRequestState(f"r{made}", prompt, SamplingParams(thinking_token_budget=budget,
                                                                          temperature=rng.choice([0.0, 1.0])),
                                       [], [], 0, None)
                made += 1
            live[s.req_id] = s
            batch.add_request(s)
        batch.condense()
        n = batch.num_reqs
        meta = batch.refresh()
        logits = torch.full((n, VOCAB), -math.inf)
        logits[:, small] = torch.randn(n, len(small))
        logits[:, 12] -= 2.0  # natural ends rarer and starts likelier, so budgets run out
        logits[:, [10, 11]] += 1.0
        keep = [rng.random() < 0.85 for _ in range(n)]  # False: a discarded prefill-chunk sample
        out = Sampler()(logits, meta, torch.tensor(keep)).sampled_token_ids.tolist()
        for row, rid in enumerate(batch.req_ids):
            s = live[rid]
            budget = s.sampling_params.thinking_token_budget
            stream = s.prompt_token_ids + s.output_token_ids
            exp = None if budget in (None, -1) else reference_forced(stream, budget)
            assert tb.forced.get(row) == exp, (step, rid)
            if exp is not None:
                assert out[row] == exp
                forced_steps += 1
            if keep[row]:
                s.output_token_ids.append(out[row])
    assert made >= 50 and forced_steps > 50
