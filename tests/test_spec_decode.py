"""Speculative decoding without a model: the n-gram proposer (against a brute-force scan), the
drafting rules, the config, KV slots for drafts in the scheduler and block manager, and rank 0's
verification: exactly what sequential plain steps give (every processor, penalties, bad words,
seeded generators), and, unseeded, the target distribution (chi-square)."""
from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest
import torch

from cluster.config import EngineConfig, SpeculativeConfig
from cluster.engine.block_manager import BlockManager
from cluster.engine.request import Request
from cluster.engine.scheduler import Scheduler
from cluster.messages import CachedRequests, StepPlan, StepResult
from cluster.sample.logits_processor import (LogitBiasLogitsProcessor, LogitsProcessors, MinPLogitsProcessor,
                                             MinTokensLogitsProcessor)
from cluster.sample.sampler import Sampler
from cluster.sample.thinking_budget import ThinkingBudget
from cluster.sampling_params import SamplingParams
from cluster.spec import Drafter, NgramIndex, NgramProposer
from cluster.spec.drafter import acceptance_threshold
from cluster.worker.input_batch import CachedRequestState, InputBatch
from cluster.worker.sampling_step import SamplingStep

EOS = 2


# ---- the n-gram proposer ------------------------------------------------------------------------------
def reference_draft(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Brute force: the longest suffix (n_max down to n_min) found earlier, latest occurrence."""
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        for end in range(length - 1, n - 1, -1):
            if tokens[end - n:end] == tokens[length - n:]:
                return tokens[end:end + k]
    return []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (2, 4), (3, 3), (1, 5)])
def test_ngram_proposer_matches_a_full_scan(n_min, n_max):
    rng = random.Random(n_min * 10 + n_max)
    proposer = NgramProposer(n_min, n_max)
    proposed = 0
    for _ in range(20):
        tokens = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        index = NgramIndex()
        while len(tokens) < 120:
            k = rng.randint(1, 5)
            got = proposer.propose(index, tokens, k)
            assert got == reference_draft(tokens, k, n_min, n_max), tokens
            proposed += bool(got)
            tokens += [rng.randrange(6) for _ in range(rng.randint(1, 3))]  # 1 token, or several accepted
    assert proposed > 100


def test_ngram_proposer_copies_the_prompt():
    passage = list(range(100, 140))
    prompt = [1, 2, 3] + passage + [7, 8]
    index, proposer = NgramIndex(), NgramProposer(2, 4)
    out = passage[:5]
    assert proposer.propose(index, prompt + out, 4) == passage[5:9]
    assert proposer.propose(index, prompt + out + passage[5:7], 4) == passage[7:11]
    assert proposer.propose(index, [5, 6, 7], 4) == []  # nothing repeats
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(3, 2)


# ---- the drafting rules -----------------------------------------------------------------------------------
def spec_config(**kw) -> SpeculativeConfig:
    cfg = SpeculativeConfig(**{"num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 2, **kw})
    return cfg.finalize()


def test_acceptance_threshold_grows_with_the_batch():
    rates = [acceptance_threshold(b) for b in (1, 2, 4, 8, 16, 32, 64, 128)]
    assert rates == sorted(rates) and rates[0] < 0.1 and rates[-1] > 0.5
    d = Drafter(spec_config())
    assert d.step_threshold(4) == acceptance_threshold(4)
    d = Drafter(spec_config(disable_by_batch_size=4, min_acceptance_rate=0.5))
    assert d.step_threshold(4) == 0.5 and d.step_threshold(5) is None


def test_drafter_stops_on_low_acceptance_and_resumes_from_shadow_drafts():
    d = Drafter(spec_config())
    cycle = [10, 11, 12, 13, 14, 15]
    tokens = cycle * 3
    assert d.propose("a", tokens, 8, 0.5) == [10, 11, 12]
    assert d.propose("a", tokens, 2, 0.5) == [10, 11]  # room left in the request / budget
    assert d.propose("a", tokens, 8, None) == []  # the step does not speculate
    for _ in range(4):  # the model keeps rejecting: the request stops drafting
        d.record("a", 3, 0)
    assert d.propose("a", tokens, 8, 0.5) == []
    # The text keeps following the cycle: the shadow drafts are scored and drafting resumes.
    for _ in range(12):
        tokens.append(cycle[len(tokens) % 6])
        if d.propose("a", tokens, 8, 0.5):
            break
    else:
        pytest.fail("a request whose text became predictable never drafted again")
    assert (d.num_drafts, d.num_draft_tokens, d.num_accepted_tokens) == (4, 12, 0)
    # A new request (a new id, or one forgotten) starts at the engine's recent average of every
    # request's drafts: lowered by the 4 failed ones, raised by the shadow drafts that matched.
    assert Drafter(spec_config()).propose("b", cycle * 3, 8, 0.99) == [10, 11, 12]  # none yet: optimistic
    d.forget("a")
    assert 0.5 < d.population_rate < 0.99
    assert d.propose("a", cycle * 3, 8, 0.99) == [] and d.propose("b", cycle * 3, 8, 0.5) == [10, 11, 12]


def test_a_new_request_starts_from_what_recent_drafts_achieved():
    """After many poor drafts (free-form text), a new request does not draft until its own
    shadow drafts show its text is predictable; after good ones it drafts at once."""
    cycle = [10, 11, 12, 13, 14, 15]
    poor = Drafter(spec_config())
    for i in range(60):
        assert poor.propose(f"free-{i % 6}", cycle * 3, 8, 0.0)  # threshold 0: it drafts
        poor.record(f"free-{i % 6}", 3, 0)
    assert poor.population_rate < 0.1
    tokens = cycle * 3
    assert poor.propose("copy", tokens, 8, 0.2) == []
    for _ in range(12):  # its text follows the cycle: shadow drafts match, and it drafts
        tokens.append(cycle[len(tokens) % 6])
        if poor.propose("copy", tokens, 8, 0.2):
            break
    else:
        pytest.fail("a predictable request among poor ones never drafted")
    good = Drafter(spec_config())
    for i in range(60):
        assert good.propose(f"copy-{i % 6}", cycle * 3, 8, 0.0)
        good.record(f"copy-{i % 6}", 3, 3)
    assert good.propose("new", cycle * 3, 8, 0.9) == [10, 11, 12]


# ---- config -----------------------------------------------------------------------------------------------
def test_speculative_config_defaults_and_errors():
    cfg = EngineConfig.create(speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                  "prompt_lookup_max": 3})
    cfg.speculative_config = cfg.speculative_config.finalize()
    assert (cfg.speculative_config.prompt_lookup_min, cfg.speculative_config.prompt_lookup_max) == (3, 3)
    both = SpeculativeConfig(num_speculative_tokens=2)
    both = both.finalize()
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)  # vLLM's default
    bad = [({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
           ({}, "speculative_config.num_speculative_tokens"),
           ({"num_speculative_tokens": 2, "method": "eagle"}, "speculative_config.method"),
           ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "speculative_config.prompt_lookup_min"),
           ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "speculative_config.prompt_lookup_max"),
           ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "speculative_config.disable_by_batch_size"),
           ({"num_speculative_tokens": 2, "min_acceptance_rate": "high"}, "speculative_config.min_acceptance_rate"),
           ({"num_speculative_tokens": 2, "min_acceptance_rate": 1.5}, "speculative_config.min_acceptance_rate")]
    for value, field in bad:
        with pytest.raises(ValueError, match=field.replace(".", r"\.")):
            SpeculativeConfig.create(value).finalize()
    with pytest.raises(ValueError, match="unknown keys"):
        EngineConfig.create(speculative_config={"num_speculative_tokens": 2, "draft_model": "x"})
    with pytest.raises(ValueError, match="speculative_config must be a dict"):
        EngineConfig.create(speculative_config=3)


def test_preset_and_deploy_args_carry_the_speculative_config():
    from actors.app import AppArgs

    cfg = EngineConfig.from_preset("smollm2-cpu-ngram")
    assert cfg.speculative_config.method == "ngram" and cfg.speculative_config.num_speculative_tokens >= 1
    args = AppArgs(preset="smollm2-cpu", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert args.engine_config().speculative_config.num_speculative_tokens == 2
    assert AppArgs().engine_config().speculative_config is None
    # `serve run` resolves the config when the app is built: a bad value stops it there.
    with pytest.raises(ValueError, match=r"speculative_config\.num_speculative_tokens"):
        AppArgs(speculative_config={"method": "ngram"}).engine_config().finalize()


# ---- KV slots for drafts ----------------------------------------------------------------------------------
def test_free_tail_releases_only_unregistered_blocks():
    bm = BlockManager(8, 4)
    tokens = list(range(9))
    assert len(bm.allocate_slots("a", tokens, 0, 9)) == 3  # 9 tokens: 2 full (cached) blocks + 1
    assert len(bm.allocate_slots("a", tokens, 9, 6)) == 1  # 6 more slots (drafts): one more block
    assert bm.num_free_blocks == 4
    assert bm.free_tail("a", 10) == 1  # accepted up to 10 tokens: 3 blocks hold them
    assert bm.num_free_blocks == 5 and len(bm.block_ids("a")) == 3
    with pytest.raises(Exception, match="prefix cache"):
        bm.free_tail("a", 4)
    bm.free("a")
    assert bm.num_free_blocks == 8


def make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64, **spec) -> Scheduler:
    config = EngineConfig.create(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=8)
    config = config.with_facts(eos_token_id=EOS)
    config.speculative_config = spec_config(**spec)
    return Scheduler(config, BlockManager(num_blocks, block_size))


def prefill(s: Scheduler, req: Request, first: int) -> None:
    s.add(req)
    while not req.output_token_ids:  # chunked when the budget is small
        plan = s.schedule()
        assert not plan.draft_token_ids
        s.update(plan, StepResult(plan.step, plan.sample_ids, [[first]] * len(plan.sample_ids)))


CYCLE = [20, 21, 22, 23, 24]


def test_scheduler_reserves_budget_and_slots_for_drafts_and_frees_rejected_ones():
    s = make_scheduler()
    req = Request("r", CYCLE[1:] + CYCLE * 2, SamplingParams(max_tokens=40), 40)  # 14 tokens
    prefill(s, req, 20)
    plan = s.schedule()
    assert plan.draft_token_ids == {"r": [21, 22, 23]}
    assert plan.num_scheduled_tokens == {"r": 4} and plan.sample_ids == ["r"]
    # Positions 14 (the last token) and 15-17 (drafts): the drafts took a fifth block.
    assert len(s.bm.block_ids("r")) == 5
    # Rank 0 rejected the first draft and sampled 30 instead: one token out, one computed;
    # the next step computes position 15, so 4 blocks stay.
    s.update(plan, StepResult(plan.step, ["r"], [[30]]))
    assert req.output_token_ids == [20, 30] and req.num_computed_tokens == 15
    assert len(s.bm.block_ids("r")) == 4 and s.bm.num_free_blocks == 60
    assert (s.drafter.num_drafts, s.drafter.num_draft_tokens, s.drafter.num_accepted_tokens) == (1, 3, 0)
    plan = s.schedule()  # the freed block is announced to the workers with the next step
    assert plan.cached.num_freed_blocks == [1]
    # All accepted plus the bonus: 4 tokens out, all 4 computed.
    req2 = Request("q", CYCLE * 3, SamplingParams(max_tokens=40), 40)
    prefill(s, req2, 20)
    plan = s.schedule()
    assert plan.draft_token_ids["q"] == [21, 22, 23]
    s.update(plan, StepResult(plan.step, plan.sample_ids,
                              [[21, 22, 23, 24] if r == "q" else [31] for r in plan.sample_ids]))
    assert req2.output_token_ids == [20, 21, 22, 23, 24] and req2.num_computed_tokens == 19


def test_drafts_respect_budget_max_tokens_free_blocks_and_stop_mid_draft():
    s = make_scheduler(max_num_batched_tokens=3)  # budget: 1 token + 2 drafts
    req = Request("r", CYCLE * 3, SamplingParams(max_tokens=40), 40)
    prefill(s, req, 20)
    assert s.schedule().draft_token_ids == {"r": [21, 22]}

    s = make_scheduler()
    req = Request("r", CYCLE * 3, SamplingParams(max_tokens=3), 3)
    prefill(s, req, 20)
    plan = s.schedule()
    assert plan.draft_token_ids == {"r": [21]}  # 1 output + 1 draft + the bonus = max_tokens
    s.update(plan, StepResult(plan.step, ["r"], [[21, 22]]))
    assert req.finish_reason == "length" and req.num_output_tokens == 3

    s = make_scheduler(num_blocks=4)  # the 16 tokens fill all 4 blocks: drafts need a 5th
    req = Request("r", CYCLE * 3, SamplingParams(max_tokens=10), 10)
    prefill(s, req, 20)
    plan = s.schedule()
    assert not plan.draft_token_ids and plan.num_scheduled_tokens == {"r": 1}
    assert s.num_preemptions == 0

    s = make_scheduler()
    req = Request("r", CYCLE * 3, SamplingParams(max_tokens=40, stop_token_ids=[22]), 40)
    prefill(s, req, 20)
    plan = s.schedule()
    s.update(plan, StepResult(plan.step, ["r"], [[21, 22, 23, 24]]))  # all accepted, then the bonus
    assert req.output_token_ids == [20, 21, 22] and req.stop_reason == 22  # stopped mid-draft
    assert s.bm.num_free_blocks == 64


# ---- rank 0: speculative verification equals sequential plain steps -------------------------------------------
VOCAB = 64
START, END = [40, 41], [42, 43]


def procs(max_num_seqs: int) -> LogitsProcessors:
    config = EngineConfig.create(max_num_seqs=max_num_seqs).with_facts(eos_token_id=EOS)
    return LogitsProcessors([MinPLogitsProcessor(config, "cpu", False), LogitBiasLogitsProcessor(config, "cpu", False),
                             MinTokensLogitsProcessor(config, "cpu", False), ThinkingBudget(START, END)])


def random_params(rng: random.Random, i: int) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.0, 0.7, 1.0])}
    if kw["temperature"]:
        kw["seed"] = 1000 + i
        kw |= rng.choice([{}, {"top_k": 5}, {"top_p": 0.8}, {"min_p": 0.1}])
    extra = rng.choice(["min_tokens", "logit_bias", "penalties", "bad_words", "allowed", "budget", "none"])
    if extra == "min_tokens":
        kw |= {"min_tokens": rng.randint(1, 6), "stop_token_ids": [5]}
    elif extra == "logit_bias":
        kw["logit_bias"] = {rng.randrange(VOCAB): 3.0, rng.randrange(VOCAB): -5.0}
    elif extra == "penalties":
        kw |= {"frequency_penalty": 0.8, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    elif extra == "bad_words":
        kw["bad_words_token_ids"] = [[7], [8, 9, 10]]
    elif extra == "allowed":
        kw["allowed_token_ids"] = list(range(0, VOCAB, 2))
    elif extra == "budget":
        kw["thinking_token_budget"] = rng.randint(0, 4)
    return SamplingParams(**kw)


def rank0_over(batch: InputBatch) -> SamplingStep:
    """Rank 0's sampling step over a prepared batch, its metadata refreshed."""
    config = EngineConfig.create(max_num_seqs=batch.max_num_reqs)
    config = config.with_facts(hf_config=SimpleNamespace(vocab_size=batch.vocab_size))
    rank0 = SamplingStep(config, "cpu")
    rank0.input_batch, rank0.metadata = batch, batch.refresh()
    return rank0


def new_batch(specs, n: int) -> tuple[InputBatch, dict[str, CachedRequestState]]:
    batch = InputBatch(n, VOCAB, "cpu", procs(n))
    states = {}
    for rid, prompt, params, out in specs:
        gen = None
        if params.seed is not None:
            gen = torch.Generator()
            gen.manual_seed(params.seed)
        states[rid] = CachedRequestState(rid, list(prompt), params, list(out), [], 0, gen)
        batch.add_request(states[rid])
    return batch, states


def test_speculative_step_equals_sequential_plain_steps_fuzz():
    """Each request has k drafts and k + 1 logits rows (row j: the model after j drafts). One
    speculative step must emit exactly what plain steps emit, stepping until a sample differs
    from the draft, and leave every seeded generator where the plain steps leave it."""
    rng = random.Random(7)
    torch.manual_seed(7)
    sampler, accepted = Sampler(), 0
    for trial in range(80):
        n = rng.randint(1, 6)
        specs, drafts, logits = [], {}, {}
        for i in range(n):
            rid = f"r{i}"
            prompt = [rng.choice([1, 3, 40, 41, 42, 43, 7, 8, 9]) for _ in range(rng.randint(1, 6))]
            out = [rng.randrange(3, 30) for _ in range(rng.randint(0, 4))]
            params = random_params(rng, trial * 10 + i)
            if params.thinking_token_budget is not None:  # a think block open at the start
                prompt += START + [rng.randrange(3, 30) for _ in range(rng.randint(0, 2))]
            specs.append((rid, prompt, params, out))
            k = rng.choice([0, 1, 3, 5])
            rows = torch.randn(k + 1, VOCAB) * 2
            draft = []
            if rng.random() < 0.3:  # a run of one token, near the top everywhere: penalties decide
                tok = rng.randrange(VOCAB)
                rows[:, tok] = rows.max(dim=1).values + 0.3
                draft = [tok] * k
            for j in range(k if not draft else 0):  # mostly the row's argmax, as a good copy
                tok = int(rows[j].argmax()) if rng.random() < 0.7 else rng.randrange(VOCAB)
                rows[j, tok] += rng.choice([0.0, 4.0])
                draft.append(tok)
            rows[:, [EOS, 5, 7, 10, 42]] += 2.0  # stop / bad / end tokens often in contention
            if draft:
                drafts[rid] = draft
            logits[rid] = rows
        order = [s[0] for s in specs]
        rng.shuffle(order)  # the runner's order differs from the batch's

        batch, states = new_batch(specs, n)
        rank0 = rank0_over(batch)
        plan = StepPlan(1, [], CachedRequests(), {r: 1 + len(drafts.get(r, ())) for r in order}, order,
                        draft_token_ids=drafts)
        flat = torch.cat([logits[r] for r in order])
        got = rank0.sample(plan, flat, order)
        got = dict(zip(got.req_ids, got.sampled_token_ids))

        ref_batch, ref_states = new_batch(specs, n)
        expected = {r: [] for r in order}
        live = set(order)
        for j in range(6):
            if not live:
                break
            meta = ref_batch.refresh()
            rows = ref_batch.req_ids[: ref_batch.num_reqs]
            step = torch.stack([logits[r][min(j, len(logits[r]) - 1)] for r in rows])
            keep = torch.tensor([r in live for r in rows])
            toks = sampler(step, meta, keep).sampled_token_ids.tolist()
            for r, t in zip(rows, toks):
                if r not in live:
                    continue
                expected[r].append(t)
                ref_states[r].output_token_ids.append(t)
                if j >= len(drafts.get(r, ())) or t != drafts[r][j]:
                    live.discard(r)
        assert got == expected, trial
        for r in order:
            accepted += len(got[r]) - 1
            g, ref_g = states[r].generator, ref_states[r].generator
            if g is not None:
                assert torch.equal(torch.rand(3, generator=g), torch.rand(3, generator=ref_g)), (trial, r)
    assert accepted > 60


def chi2_pvalue(observed: list[float], expected: list[float]) -> float:
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    df = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def bins(counts: dict[int, int], probs: torch.Tensor, total: int) -> tuple[list[float], list[float]]:
    """Observed / expected per token with >= 5 expected draws, the rest pooled."""
    big = [t for t in range(len(probs)) if probs[t] * total >= 5]
    obs = [counts.get(t, 0) for t in big]
    exp = [float(probs[t]) * total for t in big]
    obs.append(total - sum(obs))
    exp.append(total - sum(exp))
    return obs, exp


def test_random_rows_keep_the_target_distribution():
    """Unseeded draws (the global generator): the first emitted token follows p0, and after an
    accepted draft the next one follows p1 with the draft counted by the frequency penalty.
    Non-speculative sampling of p0 is checked against the same bound, and the two samples
    against each other."""
    torch.manual_seed(0)
    rows, draws = 400, 10
    p0_logits = torch.randn(VOCAB) * 1.5
    d0 = int(p0_logits.topk(3).indices[2])  # a plausible draft, not the favourite
    p0_logits[d0] += 2.0
    p1_logits = torch.randn(VOCAB) * 1.5
    p1_logits[d0] = p1_logits.max() + 1.0  # the penalty for the accepted d0 matters here
    d1 = int(p1_logits.argmax())
    params = SamplingParams(temperature=0.9, top_k=20, frequency_penalty=1.0)
    specs = [(f"r{i}", [1, 3], params, [4]) for i in range(rows)]
    order = [s[0] for s in specs]
    first: dict[int, int] = {}
    second: dict[int, int] = {}
    plain: dict[int, int] = {}
    n_accepted = 0
    sampler = Sampler()
    for _ in range(draws):
        batch, _ = new_batch(specs, rows)
        plan = StepPlan(1, [], CachedRequests(), {r: 3 for r in order}, order,
                        draft_token_ids={r: [d0, d1] for r in order})
        flat = torch.stack([p0_logits, p1_logits, torch.zeros(VOCAB)]).repeat(rows, 1)
        res = rank0_over(batch).sample(plan, flat, order)
        for toks in res.sampled_token_ids:
            first[toks[0]] = first.get(toks[0], 0) + 1
            if toks[0] == d0:
                n_accepted += 1
                second[toks[1]] = second.get(toks[1], 0) + 1
        batch, _ = new_batch(specs, rows)
        for t in sampler(p0_logits.repeat(rows, 1), batch.refresh()).sampled_token_ids.tolist():
            plain[t] = plain.get(t, 0) + 1

    def target(logits: torch.Tensor, counted: list[int]) -> torch.Tensor:
        x = logits.clone()
        for t in set(counted):
            x[t] -= counted.count(t)  # frequency_penalty = 1 per occurrence in the output
        x /= 0.9
        x[x < x.topk(20).values[-1]] = -math.inf
        return torch.softmax(x, dim=-1)

    total = rows * draws
    p0, p1 = target(p0_logits, [4]), target(p1_logits, [4, d0])
    assert 0.05 < n_accepted / total < 0.95
    assert chi2_pvalue(*bins(first, p0, total)) > 1e-3
    assert chi2_pvalue(*bins(plain, p0, total)) > 1e-3
    assert chi2_pvalue(*bins(second, p1, n_accepted)) > 1e-3
    # Two samples, one table: spec vs plain on the tokens both see often.
    common = [t for t in range(VOCAB) if first.get(t, 0) + plain.get(t, 0) >= 20]
    stat = 0.0
    for t in common:
        a, b = first.get(t, 0), plain.get(t, 0)
        e = (a + b) / 2
        stat += (a - e) ** 2 / e + (b - e) ** 2 / e
    p = float(torch.special.gammaincc(torch.tensor((len(common) - 1) / 2, dtype=torch.float64),
                                      torch.tensor(stat / 2, dtype=torch.float64)))
    assert p > 1e-3
