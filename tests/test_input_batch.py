"""The persistent batch: row placement, condense bookkeeping, the BatchUpdate it
produces, and per-row sampling state carried through moves."""
from __future__ import annotations

import random

import pytest
import torch

from cluster.config import EngineConfig
from cluster.errors import EngineInternalError
from cluster.sample import ThinkingBudget
from cluster.sample.logits_processor import (BatchUpdate, LogitsProcessor, LogitsProcessors, MoveDirectionality,
                                             build_logitsprocs)
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import CachedRequestState, InputBatch

VOCAB = 1000
UNI = MoveDirectionality.UNIDIRECTIONAL


class Recorder(LogitsProcessor):
    """Records every update_state / apply call, in order."""

    def __init__(self, log: list) -> None:
        self.log = log

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.log.append(("update", batch_update))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        self.log.append(("apply", None))
        return logits


class RecordingBudget(ThinkingBudget):
    def __init__(self, log: list) -> None:
        super().__init__([900], [901])
        self.log = log

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        self.log.append(("budget", batch_update))
        super().update_state(batch_update)


def st(req_id: str, params: SamplingParams | None = None, prompt=(5, 6, 7), output=(), seed=None):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return CachedRequestState(req_id, list(prompt), params or SamplingParams(), list(output), [1, 2], 3, gen)


def filled(n: int, log: list | None = None) -> InputBatch:
    procs = LogitsProcessors([Recorder(log if log is not None else [])])
    batch = InputBatch(16, VOCAB, "cpu", procs)
    for i in range(n):
        assert batch.add_request(st("abcdefghijklmnop"[i])) == i
    batch.refresh()
    return batch


def test_adds_fill_lowest_freed_rows_then_condense_moves_from_the_top():
    log: list = []
    batch = filled(6, log)
    log.clear()
    assert batch.remove_request("b") == 1 and batch.remove_request("d") == 3
    assert batch.remove_request("zz") is None
    g = st("g")
    assert batch.add_request(g) == 1  # the lowest freed row
    batch.condense()
    assert batch.req_ids == ["a", "g", "c", "f", "e"] and batch.num_reqs == 5
    assert batch.req_id_to_index == {"a": 0, "g": 1, "c": 2, "f": 3, "e": 4}
    batch.refresh()
    (kind, update), = [e for e in log if e[0] == "update"]
    assert update.batch_size == 5 and list(update.removed) == []
    assert [(i, p) for i, p, _, _ in update.added] == [(1, g.sampling_params)]
    assert update.added[0][2] is g.prompt_token_ids and update.added[0][3] is g.output_token_ids
    assert update.moved == [(5, 3, UNI)]


def test_trailing_holes_stay_removed_and_moves_fill_from_the_top():
    log: list = []
    batch = filled(6, log)
    for rid in ("a", "f", "c"):
        batch.remove_request(rid)
    batch.condense()
    assert batch.req_ids == ["e", "b", "d"]
    log.clear()
    batch.refresh()
    update = log[0][1]
    assert update.moved == [(4, 0, UNI), (3, 2, UNI)] and list(update.removed) == [5]
    assert update.batch_size == 3
    # Nothing changed: every processor still gets update_state(None).
    log.clear()
    batch.refresh()
    assert log == [("update", None)]


def test_add_after_condense():
    log: list = []
    batch = filled(5, log)
    batch.remove_request("e")
    batch.condense()  # nothing to move: row 4 is a trailing hole
    assert batch.req_ids == ["a", "b", "c", "d"]
    assert batch.add_request(st("x")) == 4
    log.clear()
    batch.refresh()
    update = log[0][1]
    assert [a[0] for a in update.added] == [4] and list(update.removed) == []  # never both
    batch.remove_request("b")
    batch.condense()  # x moves 4 -> 1: an add now could only land in the vacated row 4
    with pytest.raises(RuntimeError, match="add first"):
        batch.add_request(st("y"))


def test_add_and_remove_errors():
    batch = InputBatch(2, VOCAB, "cpu")
    batch.add_request(st("a"))
    with pytest.raises(EngineInternalError, match="already in the batch"):
        batch.add_request(st("a"))
    batch.add_request(st("b"))
    with pytest.raises(EngineInternalError, match="max_num_reqs=2"):
        batch.add_request(st("c"))
    with pytest.raises(ValueError, match="max_num_reqs"):
        InputBatch(0, VOCAB, "cpu")


def test_removal_after_an_add_consumed_a_freed_row_is_refused():
    batch = filled(4)
    batch.remove_request("a")
    batch.add_request(st("x"))  # reads the freed rows
    with pytest.raises(RuntimeError):
        batch.remove_request("b")


def test_request_added_and_removed_in_the_same_step():
    log: list = []
    batch = filled(3, log)
    batch.remove_request("b")
    batch.add_request(st("x"))  # takes row 1
    batch.add_request(st("y"))  # appended at row 3
    batch.remove_request("x")  # leaves before ever being sampled
    batch.remove_request("y")
    batch.condense()
    assert batch.req_ids == ["a", "c"]
    log.clear()
    batch.refresh()
    update = log[0][1]
    assert list(update.added) == [] and update.moved == [(2, 1, UNI)] and list(update.removed) == [3]


def test_refresh_updates_every_processor_and_the_budget_before_any_apply():
    log: list = []
    procs = LogitsProcessors([Recorder(log), Recorder(log), RecordingBudget(log)])
    batch = InputBatch(4, VOCAB, "cpu", procs)
    batch.add_request(st("a"))
    from cluster.sample import Sampler

    for step in range(3):
        log.clear()
        meta = batch.refresh()
        Sampler()(torch.randn(1, VOCAB), meta)
        kinds = [k for k, _ in log]
        assert kinds == ["update", "update", "budget", "apply", "apply"]
        updates = [u for k, u in log if k != "apply"]
        assert all(u is updates[0] for u in updates)  # one BatchUpdate shared by all
        assert (updates[0] is None) == (step > 0)


def test_reasoning_token_ids_build_the_budget_processor():
    config = EngineConfig.create(max_num_seqs=4).with_facts(reasoning_token_ids=([7, 8], [9]))
    budgets = [p for p in build_logitsprocs(config, "cpu", False).all if isinstance(p, ThinkingBudget)]
    assert len(budgets) == 1 and budgets[0].start == (7, 8) and budgets[0].end == (9,)
    assert not budgets[0].is_argmax_invariant()
    plain = EngineConfig.create(max_num_seqs=4)
    assert not [p for p in build_logitsprocs(plain, "cpu", False).all if isinstance(p, ThinkingBudget)]


def random_params(rng: random.Random) -> SamplingParams:
    kw: dict = {"temperature": rng.choice([0.0, 0.5, 1.0, 1.7])}
    if rng.random() < 0.4:
        kw["top_p"] = rng.choice([0.3, 0.9])
    if rng.random() < 0.4:
        kw["top_k"] = rng.choice([1, 20, VOCAB + 5])
    if rng.random() < 0.4:
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1))
    if rng.random() < 0.3:
        kw["repetition_penalty"] = rng.uniform(0.5, 2)
    if rng.random() < 0.3:
        kw["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randint(1, 6))
    if rng.random() < 0.3:
        kw["bad_words_token_ids"] = [[rng.randrange(VOCAB)] for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        kw["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.4:
        kw["seed"] = rng.randrange(1000)
    return SamplingParams(**kw)


def check_metadata(batch: InputBatch, meta, live: dict[str, CachedRequestState]) -> None:
    n = batch.num_reqs
    rows = {rid: i for i, rid in enumerate(batch.req_ids)}
    assert rows == batch.req_id_to_index and set(rows) == set(live)
    params = [live[rid].sampling_params for rid in batch.req_ids]
    assert meta.all_greedy == all(p.greedy for p in params)
    assert meta.all_random == (not any(p.greedy for p in params))
    if not meta.all_greedy:
        expected = [0.0 if p.greedy else p.temperature for p in params]
        assert meta.temperature.tolist() == pytest.approx(expected)
    assert (meta.top_p is not None) == any(p.top_p < 1 for p in params)
    if meta.top_p is not None:
        assert meta.top_p.tolist() == pytest.approx([p.top_p for p in params])
    assert (meta.top_k is not None) == any(0 < p.top_k < VOCAB for p in params)
    if meta.top_k is not None:
        assert meta.top_k.tolist() == [p.top_k if 0 < p.top_k < VOCAB else VOCAB for p in params]
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    assert meta.max_num_logprobs == (max(wanted) if wanted else None)
    for rid, row in rows.items():
        s, p = live[rid], live[rid].sampling_params
        assert meta.output_token_ids[row] is s.output_token_ids
        assert meta.generators.get(row) is s.generator
        assert meta.bad_words_token_ids.get(row) == p.bad_words_token_ids
        if meta.allowed_token_ids_mask is not None:
            allowed = set(p.allowed_token_ids or range(VOCAB))
            assert set((~meta.allowed_token_ids_mask[row]).nonzero().flatten().tolist()) == allowed
    penalized = [r for rid, r in rows.items()
                 if live[rid].sampling_params.presence_penalty or live[rid].sampling_params.frequency_penalty
                 or live[rid].sampling_params.repetition_penalty != 1.0]
    assert (meta.penalty_rows is None) == (not penalized)
    if penalized:
        assert sorted(meta.penalty_rows.tolist()) == sorted(penalized)
        for row in penalized:
            s, p = live[batch.req_ids[row]], live[batch.req_ids[row]].sampling_params
            counts = torch.bincount(torch.tensor(s.output_token_ids, dtype=torch.long), minlength=VOCAB)
            assert torch.equal(meta.output_token_counts[row].long(), counts)
            seen = set(s.prompt_token_ids) | set(s.output_token_ids)
            assert set(meta.seen_token_mask[row].nonzero().flatten().tolist()) == seen
            assert meta.frequency_penalties[row].item() == pytest.approx(p.frequency_penalty)
            assert meta.presence_penalties[row].item() == pytest.approx(p.presence_penalty)
            assert meta.repetition_penalties[row].item() == pytest.approx(p.repetition_penalty)
    assert n == len(meta.output_token_ids)


@pytest.mark.parametrize("seed", [0, 1])
def test_per_row_state_follows_moves_fuzz(seed):
    rng = random.Random(seed)
    batch = InputBatch(64, VOCAB, "cpu")
    live: dict[str, CachedRequestState] = {}
    parked: list[CachedRequestState] = []
    made = 0
    for _ in range(40):
        for rid in rng.sample(sorted(live), k=rng.randint(0, min(len(live), 10))):
            batch.remove_request(rid)
            if rng.random() < 0.4:
                parked.append(live[rid])
            del live[rid]
        for _ in range(rng.randint(0, 12)):
            if len(live) == 64:
                break
            if parked and rng.random() < 0.3:
                s = parked.pop()
            else:
                p = random_params(rng)
                s = st(f"r{made}", p, prompt=[rng.randrange(VOCAB) for _ in range(rng.randint(1, 20))],
                       output=[rng.randrange(VOCAB) for _ in range(rng.randint(0, 4))], seed=p.seed)
                made += 1
            live[s.req_id] = s
            batch.add_request(s)
        batch.condense()
        check_metadata(batch, batch.refresh(), live)
        for s in live.values():
            s.output_token_ids.extend(rng.randrange(VOCAB) for _ in range(rng.choice([1, 1, 2])))
    assert made >= 50
