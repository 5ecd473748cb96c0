"""The sampler: constraint order, penalties, bad words, allowed ids, greedy / random sampling
with seeds, top-k / top-p, and processed logprobs. Random logits, vocab 1000, CPU."""
from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from cluster.config import EngineConfig
from cluster.sample import Sampler
from cluster.sample.logits_processor import BatchUpdate, LogitsProcessor, build_logitsprocs
from cluster.sample.ops import fast_argmax, fast_topk, mask_below_
from cluster.sample.sampler import apply_top_k_top_p, nucleus_threshold
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import CachedRequestState, InputBatch

VOCAB, EOS = 1000, 2


def make_batch(params: list[SamplingParams], prompts=None, outputs=None, extra_procs=(), max_reqs=None):
    cfg = EngineConfig.create(max_num_seqs=max_reqs or max(len(params), 1)).with_facts(eos_token_id=EOS)
    procs = build_logitsprocs(cfg, "cpu", False, custom=list(extra_procs))
    batch = InputBatch(max_reqs or max(len(params), 1), VOCAB, "cpu", procs)
    states = []
    for i, p in enumerate(params):
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None and not p.greedy else None
        s = CachedRequestState(f"r{i}", list(prompts[i] if prompts else [11, 12, 13]), p,
                               list(outputs[i] if outputs else []), [], 0, gen)
        batch.add_request(s)
        states.append(s)
    return batch, states


def rand_logits(n: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


# ---- constraints before the argmax -----------------------------------------------------------------
def reference_penalties(row: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    out = row.double().clone()
    for tok in set(prompt) | set(output):
        out[tok] = out[tok] / p.repetition_penalty if out[tok] > 0 else out[tok] * p.repetition_penalty
    for tok, cnt in Counter(output).items():
        out[tok] -= p.frequency_penalty * cnt + p.presence_penalty
    return out


@pytest.mark.parametrize("some_plain", [True, False])
def test_penalties_match_reference(some_plain):
    rng = random.Random(0)
    params, prompts, outputs = [], [], []
    for i in range(24):
        kw = {}
        if i % 4 != 3 or not some_plain:  # then every fourth row has none: must stay bit-identical
            kw = dict(presence_penalty=rng.uniform(-2, 2), frequency_penalty=rng.uniform(-2, 2),
                      repetition_penalty=rng.choice([1.0, rng.uniform(0.3, 3)]))
        params.append(SamplingParams(**kw))
        prompts.append([rng.randrange(50) for _ in range(rng.randint(1, 30))])
        outputs.append([rng.randrange(60) for _ in range(rng.randint(0, 40))])
    batch, states = make_batch(params, prompts, outputs)
    logits = rand_logits(24, 1)
    for step in range(3):  # counts follow outputs that grow between steps
        meta = batch.refresh()
        got = Sampler.apply_constraints(logits.clone(), meta)
        for i, s in enumerate(states):
            if i % 4 == 3 and some_plain:
                assert torch.equal(got[i], logits[i])
            else:
                exp = reference_penalties(logits[i], s.sampling_params, s.prompt_token_ids,
                                          s.output_token_ids)
                torch.testing.assert_close(got[i].double(), exp, rtol=1e-5, atol=1e-4)
        for s in states:
            s.output_token_ids.extend(rng.randrange(60) for _ in range(2))


def test_bad_words_ban_last_token_after_matching_prefix():
    words = [[5], [7, 8], [1, 2, 3]]
    outputs = [[], [9, 7], [4, 1, 2], [1, 2, 7], [2]]
    params = [SamplingParams(bad_words_token_ids=words) for _ in outputs] + [SamplingParams()]
    batch, _ = make_batch(params, outputs=outputs + [[7]])
    got = Sampler.apply_constraints(torch.zeros(len(params), VOCAB), batch.refresh())
    banned = [set(torch.isinf(r).nonzero().flatten().tolist()) for r in got]
    assert banned == [{5}, {5, 8}, {5, 3}, {5, 8}, {5}, set()]


def test_allowed_token_ids_restrict_sampling():
    allowed = [3, 500, 999]
    params = [SamplingParams(allowed_token_ids=allowed, seed=i) for i in range(6)]
    params.append(SamplingParams(temperature=0))
    batch, _ = make_batch(params)
    meta = batch.refresh()
    got = Sampler.apply_constraints(rand_logits(7, 2), meta)
    for row in range(6):
        assert set(torch.isfinite(got[row]).nonzero().flatten().tolist()) == set(allowed)
    assert torch.isfinite(got[6]).all()
    for seed in range(5):
        out = Sampler()(rand_logits(7, seed + 10), meta)
        assert set(out.sampled_token_ids[:6].tolist()) <= set(allowed)


class NeverOnGreedy(LogitsProcessor):
    """An argmax-invariant processor that records being applied."""

    applied = 0

    def __init__(self, config, device, is_pin_memory) -> None:
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        type(self).applied += 1
        return logits


def test_greedy_is_argmax_and_skips_argmax_invariant_processors():
    params = [SamplingParams(temperature=0.0, logit_bias={7: 50.0}), SamplingParams(temperature=0.0)]
    batch, _ = make_batch(params, extra_procs=[NeverOnGreedy])
    logits = rand_logits(2, 3)
    NeverOnGreedy.applied = 0
    out = Sampler()(logits.clone(), batch.refresh())
    assert out.sampled_token_ids.tolist() == [7, int(logits[1].argmax())]
    assert NeverOnGreedy.applied == 0 and out.logprobs is None
    batch2, _ = make_batch(params + [SamplingParams()], extra_procs=[NeverOnGreedy])
    logits = rand_logits(3, 4)
    out = Sampler()(logits.clone(), batch2.refresh())
    assert NeverOnGreedy.applied == 1  # a random row present: the processor runs
    assert out.sampled_token_ids[:2].tolist() == [7, int(logits[1].argmax())]


@pytest.mark.parametrize("vocab", [1, 7, 1000, 1024, 49152])
def test_chunked_argmax_and_topk_match_torch(vocab):
    gen = torch.Generator().manual_seed(vocab)
    x = torch.randint(-5, 6, (9, vocab), generator=gen).float()  # many ties
    x[0] = -math.inf
    x[1, -1] = 100.0  # the maximum in a last partial chunk
    assert torch.equal(fast_argmax(x), x.argmax(dim=-1))
    for k in {1, min(3, vocab), min(40, vocab)}:
        vals, idx = fast_topk(x, k)
        assert torch.equal(vals, x.topk(k, dim=-1).values) and torch.equal(x.gather(1, idx), vals)
        assert all(len(set(r)) == k for r in idx.tolist())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mask_below_is_exact(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(6, VOCAB, generator=gen) * 4).to(dtype)
    x[:, ::7] = -math.inf
    t = torch.tensor([[-math.inf], [0.0], [1.5], [math.inf], [-3.0], [0.0]], dtype=dtype)
    t[5, 0] = x[5, 3]  # a value exactly at the threshold stays
    t[1, 0] = x[1].max()
    out = mask_below_(x.clone(), t)
    assert torch.equal(out, torch.where(x < t, torch.tensor(-math.inf, dtype=dtype), x))
    assert out[5, 3] == x[5, 3] and torch.isfinite(out[1]).sum() >= 1 and not out.isnan().any()


# ---- random sampling --------------------------------------------------------------------------------
def test_random_sampling_follows_the_distribution():
    torch.manual_seed(0)
    tokens, probs = [3, 40, 41, 500, 999], [0.1, 0.2, 0.3, 0.15, 0.25]
    n = 6000
    batch, _ = make_batch([SamplingParams(temperature=1.0)] * n)
    logits = torch.full((n, VOCAB), -math.inf)
    logits[:, tokens] = torch.tensor(probs).log() + 4.0  # any shift: softmax is shift-invariant
    out = Sampler()(logits, batch.refresh()).sampled_token_ids
    counts = Counter(out.tolist())
    assert set(counts) <= set(tokens)
    for tok, p in zip(tokens, probs):
        sd = math.sqrt(p * (1 - p) / n)
        assert abs(counts[tok] / n - p) < 5 * sd, (tok, counts[tok] / n, p)


def test_temperature_scales_the_distribution():
    torch.manual_seed(1)
    n = 6000
    batch, _ = make_batch([SamplingParams(temperature=0.5)] * n)
    logits = torch.full((n, VOCAB), -math.inf)
    logits[:, [10, 600]] = torch.tensor([0.0, math.log(3.0)])  # p = 1/4, 3/4 at temperature 1
    out = Sampler()(logits, batch.refresh()).sampled_token_ids
    frac = (out == 600).float().mean().item()
    assert abs(frac - 0.9) < 5 * math.sqrt(0.09 / n)  # 3^2 / (1 + 3^2) at temperature 0.5


def run_seeded(params: list[SamplingParams], logits_rows: list[torch.Tensor], steps: int,
               masks: dict[int, list[bool]] | None = None) -> list[list[int]]:
    """Sample `steps` times; returns per request the tokens of its sampled steps."""
    batch, states = make_batch(params)
    got: list[list[int]] = [[] for _ in params]
    for step in range(steps):
        meta = batch.refresh()
        rows = [batch.req_id_to_index[s.req_id] for s in states]
        logits = torch.empty(len(params), VOCAB)
        for i, r in enumerate(rows):
            logits[r] = logits_rows[i]
        mask = None
        if masks and step in masks:
            mask = torch.tensor([masks[step][states.index(next(s for s in states if s.req_id == rid))]
                                 for rid in batch.req_ids])
        out = Sampler()(logits, meta, mask).sampled_token_ids.tolist()
        for i, r in enumerate(rows):
            if mask is None or mask[r]:
                got[i].append(out[r])
                states[i].output_token_ids.append(out[r])
    return got


def test_same_seed_same_samples_regardless_of_batch():
    flat = torch.zeros(VOCAB)
    a = run_seeded([SamplingParams(seed=7), SamplingParams(seed=8)], [flat, flat], 12)
    b = run_seeded([SamplingParams(temperature=0.0), SamplingParams(), SamplingParams(seed=8),
                    SamplingParams(seed=7, top_k=VOCAB + 1)], [flat] * 4, 12)
    assert a[0] == b[3] and a[1] == b[2]
    c = run_seeded([SamplingParams(seed=9)], [flat], 12)
    assert c[0] != a[0] and a[0] != a[1]
    # Unseeded rows differ between runs.
    d1, d2 = run_seeded([SamplingParams()], [flat], 12), run_seeded([SamplingParams()], [flat], 12)
    assert d1 != d2


def test_discarded_rows_do_not_advance_their_generator():
    flat = torch.zeros(VOCAB)
    params = [SamplingParams(seed=3), SamplingParams(seed=4)]
    plain = run_seeded(params, [flat, flat], 8)
    # Request 0 is a non-final prefill chunk at steps 0 and 3: its samples there are discarded.
    masked = run_seeded(params, [flat, flat], 10, masks={0: [False, True], 3: [False, True]})
    assert masked[0] == plain[0][:8] and len(masked[0]) == 8
    assert masked[1][:8] == plain[1]


# ---- top-k / top-p -----------------------------------------------------------------------------------
def reference_keep(row: torch.Tensor, k: int, p: float) -> set[int]:
    vals = row.double()
    order = sorted(range(VOCAB), key=lambda t: -vals[t].item())
    if 0 < k < VOCAB:
        order = order[:k]
    if p >= 1.0:  # top-p disabled
        return set(order)
    probs = torch.softmax(vals[order], dim=0).tolist()
    kept, above = [], 0.0
    for tok, pr in zip(order, probs):
        if above >= p and kept:
            break
        kept.append(tok)
        above += pr
    return set(kept)


@pytest.mark.parametrize("scale", [0.02, 1.0, 6.0])  # flat (full-sort fallback) to peaked
def test_top_k_top_p_keep_exactly_the_reference_set(scale):
    cases = [(0, 0.3), (0, 0.9), (0, 0.99), (5, 1.0), (100, 1.0), (20, 0.5), (1, 0.9), (0, 1.0)]
    logits = rand_logits(len(cases), 5, scale)
    k = torch.tensor([c[0] if c[0] else VOCAB for c in cases])
    p = torch.tensor([c[1] for c in cases], dtype=torch.float32)
    out = apply_top_k_top_p(logits.clone(), k, p)
    for i, (kk, pp) in enumerate(cases):
        kept = set(torch.isfinite(out[i]).nonzero().flatten().tolist())
        assert kept == reference_keep(logits[i], kk, pp), (i, kk, pp)
        assert torch.equal(out[i][list(kept)], logits[i][list(kept)])


def sorted_threshold(probs: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    ranked = probs.double().sort(dim=-1, descending=True).values
    above = ranked.cumsum(-1) - ranked
    keep = (above < p.double().unsqueeze(1)).sum(-1)
    return ranked.gather(1, (keep - 1).unsqueeze(1)).squeeze(1).to(probs.dtype)


@pytest.mark.parametrize("vocab", [VOCAB, 60_000, 1_200_000])  # candidates at 1e-4, at 1e-6, full sort
def test_nucleus_threshold_matches_full_sort(vocab):
    gen = torch.Generator().manual_seed(vocab)
    rows = 16 if vocab < 10**6 else 1
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen)
                          * torch.linspace(0.05, 8, rows).unsqueeze(1), dim=-1)
    p = torch.rand(rows, generator=gen) * 0.98 + 0.01
    assert torch.equal(nucleus_threshold(probs, p), sorted_threshold(probs, p))


def test_top_p_sampling_stays_in_the_nucleus():
    n = 400
    batch, _ = make_batch([SamplingParams(top_p=0.6, seed=i) for i in range(n)])
    logits = rand_logits(1, 6).expand(n, VOCAB).clone()
    nucleus = reference_keep(logits[0], 0, 0.6)
    out = Sampler()(logits, batch.refresh()).sampled_token_ids
    assert set(out.tolist()) <= nucleus and len(set(out.tolist())) > 1


# ---- logprobs ---------------------------------------------------------------------------------------
def test_logprobs_are_log_softmax_of_processed_logits():
    params = [SamplingParams(temperature=0.7, top_k=20, min_p=0.05, logit_bias={4: 3.0}, logprobs=5, seed=1),
              SamplingParams(temperature=0.0, logprobs=2, presence_penalty=1.0),
              SamplingParams(temperature=1.3, top_p=0.8, logprobs=0, seed=2),
              SamplingParams(seed=3)]
    batch, states = make_batch(params, outputs=[[], [5, 5, 6], [], []])
    logits = rand_logits(4, 7)
    out = Sampler()(logits.clone(), batch.refresh())
    assert out.logprobs.shape == (4, 6) and out.logprob_token_ids.shape == (4, 6)
    # Processed logits, rebuilt independently per row.
    r0 = logits[0].clone()
    r0[4] += 3.0
    r0 = r0 / 0.7
    pr = torch.softmax(r0.double(), 0)
    r0[pr < 0.05 * pr.max()] = -math.inf
    r0[r0 < r0.topk(20).values[-1]] = -math.inf
    r1 = logits[1].clone()
    r1[[5, 6]] -= 1.0
    r2 = logits[2] / 1.3
    r2 = torch.where(torch.isin(torch.arange(VOCAB), torch.tensor(sorted(reference_keep(r2, 0, 0.8)))),
                     r2, torch.tensor(-math.inf))
    r3 = logits[3]
    for row, (proc, k) in enumerate(zip([r0, r1, r2, r3], [5, 2, 0, 0])):
        lp = torch.log_softmax(proc.double(), 0)
        tok = int(out.sampled_token_ids[row])
        assert int(out.logprob_token_ids[row, 0]) == tok
        assert out.logprobs[row, 0].item() == pytest.approx(lp[tok].item(), abs=1e-4)
        assert int(out.sampled_ranks[row]) == int((lp >= lp[tok]).sum())
        top = lp.topk(k)
        finite = torch.isfinite(top.values)  # which -inf token fills the tail is arbitrary
        assert out.logprob_token_ids[row, 1:k + 1][finite].tolist() == top.indices[finite].tolist()
        torch.testing.assert_close(out.logprobs[row, 1:k + 1].double(), top.values, atol=1e-4, rtol=0)
    assert int(out.sampled_token_ids[1]) == int(r1.argmax()) and int(out.sampled_ranks[1]) == 1


def test_min_p_runs_after_temperature():
    params = [SamplingParams(temperature=t, min_p=0.2, logprobs=0) for t in (0.5, 2.0)]
    batch, _ = make_batch(params)
    row = rand_logits(1, 8)[0]
    out_logits = batch.refresh()
    from cluster.sample.sampler import apply_temperature

    scaled = apply_temperature(row.expand(2, VOCAB).clone(), out_logits.temperature, True)
    kept = [set(torch.isfinite(r).nonzero().flatten().tolist())
            for r in out_logits.logitsprocs.argmax_invariant[0].apply(scaled)]
    for t, ks in zip((0.5, 2.0), kept):
        pr = torch.softmax(row.double() / t, 0)
        assert ks == set((pr >= 0.2 * pr.max()).nonzero().flatten().tolist())
    assert len(kept[1]) > len(kept[0])


def test_empty_batch_and_bf16_input():
    batch, _ = make_batch([])
    assert Sampler()(torch.empty(0, VOCAB), batch.refresh()).sampled_token_ids.numel() == 0
    batch, _ = make_batch([SamplingParams(temperature=0.0, logprobs=1)])
    logits = rand_logits(1, 9).bfloat16()
    out = Sampler()(logits, batch.refresh())
    assert int(out.sampled_token_ids[0]) == int(logits.float().argmax())
    assert out.logprobs.dtype == torch.float32
