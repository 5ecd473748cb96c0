"""Logits processors: the BatchUpdate contract, the built-ins under a persistent-batch fuzz,
custom processors loaded by FQCN / class / entry point, and the adapter."""
from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch

from cluster.config import EngineConfig
from cluster.sample import Sampler
from cluster.sample.logits_processor import (AdapterLogitsProcessor, BatchUpdate, BatchUpdateBuilder,
                                             LogitBiasLogitsProcessor, LogitsProcessor, LogitsProcessors,
                                             MinPLogitsProcessor, MinTokensLogitsProcessor,
                                             MoveDirectionality, build_logitsprocs,
                                             load_custom_logitsprocs, process_dict_updates,
                                             validate_request_params)
from cluster.sampling_params import SamplingParams
from cluster.worker.input_batch import CachedRequestState, InputBatch

VOCAB, EOS, MAX_REQS = 1000, 2, 64
FIXTURES = Path(__file__).parent / "fixtures"
UNI, SWAP = MoveDirectionality.UNIDIRECTIONAL, MoveDirectionality.SWAP


@pytest.fixture
def dummy_module(monkeypatch):
    monkeypatch.syspath_prepend(str(FIXTURES))
    import dummy_logitsprocs

    return dummy_logitsprocs


def config(procs=(), max_num_seqs=MAX_REQS, eos=EOS) -> EngineConfig:
    cfg = EngineConfig.create(max_num_seqs=max_num_seqs, logits_processors=list(procs))
    return cfg.with_facts(eos_token_id=eos)  # what finalize learns from the tokenizer


def state(req_id: str, params: SamplingParams, prompt=None, output=None, seed=None) -> CachedRequestState:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return CachedRequestState(req_id, list(prompt or [5, 6, 7]), params, list(output or []), [], 0, gen)


# ---- BatchUpdateBuilder / process_dict_updates contract ----------------------------------------
def test_batch_update_builder_contract():
    b = BatchUpdateBuilder()
    assert not b.batch_changed and b.get_and_reset(0) is None
    for i in (4, 1, 7):
        b.removed_append(i)
    assert b.batch_changed and b.has_removed()
    assert b.removed == [7, 4, 1]  # descending
    with pytest.raises(RuntimeError):
        b.removed_append(9)  # removals are closed once `removed` was read
    assert b.peek_removed() == 1 and b.pop_removed() == 1 and b.peek_removed() == 4
    params = SamplingParams()
    out: list[int] = []
    b.added.append((1, params, [1], out))
    b.moved.append((7, 4, UNI))
    update = b.get_and_reset(6)
    assert isinstance(update, BatchUpdate) and update.batch_size == 6
    assert list(update.removed) == [7, 4] and update.added[0][3] is out and update.moved == [(7, 4, UNI)]
    with pytest.raises(Exception):
        update.batch_size = 3  # frozen
    # After get_and_reset: empty, and removals are open again.
    assert not b.batch_changed and b.get_and_reset(6) is None and b.pop_removed() is None
    b.removed_append(2)
    assert b.reset() is True and b.get_and_reset(6) is None and b.reset() is False
    b.moved.append((0, 1, SWAP))
    assert b.batch_changed and b.get_and_reset(2).moved == [(0, 1, SWAP)]


def test_process_dict_updates_semantics():
    p_yes, p_no = SamplingParams(extra_args={"v": 1}), SamplingParams()
    new = lambda params, _p, _o: (params.extra_args or {}).get("v")  # noqa: E731
    entries = {0: "a", 1: "b", 2: "c", 3: "d"}
    assert process_dict_updates(entries, None, new) is False
    upd = BatchUpdate(4, removed=[3], added=[(1, p_no, None, []), (5, p_yes, None, [])],
                      moved=[(2, 0, UNI), (5, 1, SWAP)])
    assert process_dict_updates(entries, upd, new) is True
    # 3 removed; 1 replaced by a request without state; 2 -> 0 overwrites "a"; 5 <-> 1 swaps.
    assert entries == {0: "c", 1: 1}
    assert process_dict_updates(entries, BatchUpdate(2, [], [(3, p_no, None, [])], []), new) is False


# ---- the persistent-batch fuzz --------------------------------------------------------------------
def random_params(rng: random.Random) -> SamplingParams:
    kw: dict = {}
    if rng.random() < 0.2:
        kw["temperature"] = 0.0
    if rng.random() < 0.4:
        kw["min_p"] = rng.choice([0.02, 0.1, 0.3, 0.7])
    if rng.random() < 0.4:
        kw["logit_bias"] = {rng.randrange(VOCAB): round(rng.uniform(-8, 8), 3)
                            for _ in range(rng.randint(1, 5))}
    if rng.random() < 0.5:
        kw["min_tokens"] = rng.randint(1, 8)
        kw["stop_token_ids"] = rng.sample(range(VOCAB), rng.randint(0, 3))
        kw["ignore_eos"] = rng.random() < 0.3
    if rng.random() < 0.3:
        kw["extra_args"] = {"target_token": rng.randrange(VOCAB)}
    return SamplingParams(**kw)


def expected_row(proc: LogitsProcessor, st: CachedRequestState,
                 row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(expected values, mask of positions to compare) for one request's row, from its params."""
    p, exp, check = st.sampling_params, row.clone(), torch.ones_like(row, dtype=torch.bool)
    if isinstance(proc, MinPLogitsProcessor) and p.min_p > 0:
        probs = torch.softmax(row.double(), dim=0)
        threshold = p.min_p * probs.max()
        exp[probs < threshold] = -math.inf
        check = (probs - threshold).abs() > 1e-9  # leave float ties at the threshold out
    elif isinstance(proc, LogitBiasLogitsProcessor) and p.logit_bias:
        for tok, bias in p.logit_bias.items():
            exp[tok] = exp[tok] + bias
    elif isinstance(proc, MinTokensLogitsProcessor) and len(st.output_token_ids) < p.min_tokens:
        stops = set(p.stop_token_ids or []) | (set() if p.ignore_eos else {EOS})
        exp[list(stops)] = -math.inf
    elif type(proc).__name__ in ("DummyLogitsProcessor", "WrappedPerReqLogitsProcessor"):
        target = (p.extra_args or {}).get("target_token")
        if target is not None:
            exp[:] = -math.inf
            exp[target] = row[target]
    return exp, check


class Mirror(LogitsProcessor):
    """Tracks row -> request (by its live output list) from BatchUpdates alone, applying
    them in the documented order or in vLLM's built-ins' order (added first)."""

    def __init__(self, added_first: bool) -> None:
        self.added_first, self.rows, self.batch_size = added_first, {}, 0

    def is_argmax_invariant(self) -> bool:
        return False

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def update_state(self, update: BatchUpdate | None) -> None:
        if update is None:
            return
        removed, added = set(update.removed), {a[0] for a in update.added}
        assert not removed & added and all(i >= update.batch_size for i in removed)
        assert all(i < update.batch_size for i in added)
        steps = [lambda: [self.rows.pop(i, None) for i in update.removed],
                 lambda: self.rows.update({a[0]: a[3] for a in update.added})]
        for step in steps[::-1] if self.added_first else steps:
            step()
        for a, b, direction in update.moved:
            assert b < update.batch_size and (direction == UNI or a < update.batch_size)
            va, vb = self.rows.pop(a, None), self.rows.pop(b, None)
            if va is not None:
                self.rows[b] = va
            if vb is not None and direction == SWAP:
                self.rows[a] = vb
        self.batch_size = update.batch_size


def run_fuzz(seed: int, procs: LogitsProcessors, steps: int, pool: int) -> int:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    mirrors = [Mirror(False), Mirror(True)]
    batch = InputBatch(MAX_REQS, VOCAB, "cpu", LogitsProcessors([*procs.all, *mirrors]))
    live: dict[str, CachedRequestState] = {}
    parked: list[CachedRequestState] = []  # removed but resumable (preempted)
    made = 0
    checked_rows = 0
    for _ in range(steps):
        for rid in rng.sample(sorted(live), k=rng.randint(0, min(len(live), 12))):
            assert batch.remove_request(rid) is not None
            if rng.random() < 0.3:
                parked.append(live[rid])
            del live[rid]
        if rng.random() < 0.2:
            batch.condense()  # early: later adds must not reuse trailing holes past the live rows
        for _ in range(rng.randint(0, 14)):
            if len(live) == MAX_REQS:
                break
            if parked and rng.random() < 0.3:
                st = parked.pop(rng.randrange(len(parked)))
            elif made < pool:
                st = state(f"r{made}", random_params(rng), output=[rng.randrange(VOCAB)
                                                                    for _ in range(rng.randint(0, 3))])
                made += 1
            else:
                continue
            try:
                batch.add_request(st)
            except RuntimeError:  # the early condense moved rows: adds must wait a step
                parked.append(st)
                break
            live[st.req_id] = st
        batch.condense()
        n = batch.num_reqs
        batch.refresh()
        assert len(batch.req_ids) == n and sorted(batch.req_ids) == sorted(live)
        for mirror in mirrors:
            assert {i: id(out) for i, out in mirror.rows.items()} == {
                i: id(live[rid].output_token_ids) for i, rid in enumerate(batch.req_ids)}
        logits = torch.randn(n, VOCAB, generator=gen) * 3
        for proc in procs.all:
            out = proc.apply(logits.clone())
            for row, rid in enumerate(batch.req_ids):
                exp, check = expected_row(proc, live[rid], logits[row])
                assert torch.equal(out[row][check], exp[check]), (type(proc).__name__, rid, row)
                checked_rows += 1
        for st in live.values():  # this step's sampled token
            st.output_token_ids.append(rng.randrange(VOCAB))
    assert made >= 50
    return checked_rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_builtins_persistent_batch_fuzz(seed):
    procs = build_logitsprocs(config(), "cpu", False)
    assert run_fuzz(seed, procs, steps=60, pool=200) > 1000


def test_custom_and_adapter_persistent_batch_fuzz(dummy_module):
    cfg = config([dummy_module.DummyLogitsProcessor, dummy_module.WrappedPerReqLogitsProcessor])
    procs = build_logitsprocs(cfg, "cpu", False)
    assert len(procs.non_argmax_invariant) == 4 and len(procs.argmax_invariant) == 1
    run_fuzz(7, procs, steps=30, pool=80)


def test_builtins_fast_path_and_argmax_invariance():
    procs = build_logitsprocs(config(), "cpu", False)
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    batch = InputBatch(8, VOCAB, "cpu", procs)
    for i in range(4):
        batch.add_request(state(f"q{i}", SamplingParams(temperature=0.7)))
    batch.refresh()
    logits = torch.randn(4, VOCAB)
    for proc in procs.all:
        out = proc.apply(logits.clone())
        assert torch.equal(out, logits)  # no row uses them: untouched
    batch.add_request(state("mp", SamplingParams(min_p=0.3)))
    batch.refresh()
    logits = torch.randn(5, VOCAB)
    out = procs.argmax_invariant[0].apply(logits.clone())
    assert torch.equal(out.argmax(-1), logits.argmax(-1)) and torch.equal(out[:4], logits[:4])
    assert torch.isinf(out[4]).any()


def test_min_tokens_uses_live_output_and_eos_list():
    procs = build_logitsprocs(config(eos=[EOS, 3]), "cpu", False)
    batch = InputBatch(4, VOCAB, "cpu", procs)
    st = state("a", SamplingParams(min_tokens=2, stop_token_ids=[9]))
    batch.add_request(st)
    mt = procs.non_argmax_invariant[1]
    assert isinstance(mt, MinTokensLogitsProcessor)

    def banned() -> set[int]:
        return set(torch.isinf(mt.apply(torch.zeros(1, VOCAB))[0]).nonzero().flatten().tolist())

    batch.refresh()
    assert banned() == {2, 3, 9}
    st.output_token_ids.append(11)
    batch.refresh()  # no batch change, the live list grew
    assert banned() == {2, 3, 9}
    st.output_token_ids.append(12)
    batch.refresh()
    assert banned() == set()


# ---- custom processors: loading, validation, behaviour ---------------------------------------------
def target_run(procs: LogitsProcessors, params: list[SamplingParams], logits: torch.Tensor):
    batch = InputBatch(8, VOCAB, "cpu", procs)
    for i, p in enumerate(params):
        batch.add_request(state(f"t{i}", p, seed=100 + i))
    out = Sampler()(logits.clone(), batch.refresh())
    return out.sampled_token_ids, out.logprobs


TARGET_PARAMS = [SamplingParams(extra_args={"target_token": 17}), SamplingParams(temperature=0.8, seed=1),
                 SamplingParams(temperature=1.2, top_k=50, extra_args={"target_token": 402}, logprobs=2),
                 SamplingParams(temperature=0.0, logprobs=3),
                 SamplingParams(min_p=0.1, extra_args={"other": 1})]


def check_target_behaviour(cfg: EngineConfig) -> None:
    logits = torch.randn(len(TARGET_PARAMS), VOCAB, generator=torch.Generator().manual_seed(3)) * 2
    with_proc, lp_with = target_run(build_logitsprocs(cfg, "cpu", False), TARGET_PARAMS, logits)
    plain, lp_plain = target_run(build_logitsprocs(config(), "cpu", False), TARGET_PARAMS, logits)
    assert with_proc[0] == 17 and with_proc[2] == 402
    for row in (1, 3, 4):  # rows without a target: identical to a run without the processor
        assert with_proc[row] == plain[row] and torch.equal(lp_with[row], lp_plain[row])


def test_dummy_loaded_by_fqcn_colon_and_dot(dummy_module):
    for spec in ("dummy_logitsprocs:DummyLogitsProcessor", "dummy_logitsprocs.DummyLogitsProcessor"):
        cfg = config([spec])
        assert load_custom_logitsprocs(cfg) == [dummy_module.DummyLogitsProcessor]
        check_target_behaviour(cfg)


def test_dummy_and_adapter_loaded_by_class(dummy_module):
    check_target_behaviour(config([dummy_module.DummyLogitsProcessor]))
    check_target_behaviour(config([dummy_module.WrappedPerReqLogitsProcessor]))


@pytest.mark.parametrize("cls_name", ["DummyLogitsProcessor", "WrappedPerReqLogitsProcessor"])
def test_loaded_through_entry_point(dummy_module, tmp_path, monkeypatch, cls_name):
    dist = tmp_path / "dummy_logitsprocs_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: dummy-logitsprocs-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        f"[llm_cluster.logits_processors]\ndummy = dummy_logitsprocs:{cls_name}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = config()
    assert load_custom_logitsprocs(cfg) == [getattr(dummy_module, cls_name)]
    check_target_behaviour(cfg)


def test_bad_entry_point_is_rejected(dummy_module, tmp_path, monkeypatch):
    dist = tmp_path / "broken_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[llm_cluster.logits_processors]\nbroken = dummy_logitsprocs:NotAProcessor\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="broken"):
        load_custom_logitsprocs(config())


def test_validate_request_params(dummy_module):
    classes = load_custom_logitsprocs(config(["dummy_logitsprocs:DummyLogitsProcessor"]))
    validate_request_params(classes, SamplingParams(extra_args={"target_token": 5}))
    validate_request_params(classes, SamplingParams())
    with pytest.raises(ValueError, match="target_token value 'x' is not int"):
        validate_request_params(classes, SamplingParams(extra_args={"target_token": "x"}))
    with pytest.raises(ValueError, match="not int"):
        validate_request_params(classes, SamplingParams(extra_args={"target_token": 1.5}))


@pytest.mark.parametrize("spec, fragment", [
    ("dummy_logitsprocs:NoSuchClass", "NoSuchClass"),
    ("no_such_module_xyz:Proc", "no_such_module_xyz"),
    ("no_such_module_xyz.Proc", "no_such_module_xyz"),
    ("JustAName", "JustAName"),
    ("dummy_logitsprocs:NOT_A_CLASS", "not a class"),
    ("dummy_logitsprocs:NotAProcessor", "not a subclass"),
    (int, "not a subclass"),
    ("cluster.sample.logits_processor:AdapterLogitsProcessor", "abstract"),
])
def test_bad_processor_specs_raise_value_error(dummy_module, spec, fragment):
    with pytest.raises(ValueError, match=fragment):
        build_logitsprocs(config([spec]), "cpu", False)


def test_adapter_passes_prompt_to_three_argument_callables(dummy_module):
    procs = build_logitsprocs(config([dummy_module.PromptAwareAdapter]), "cpu", False)
    adapter = next(p for p in procs.all if isinstance(p, AdapterLogitsProcessor))
    batch = InputBatch(4, VOCAB, "cpu", procs)
    batch.add_request(state("plain", SamplingParams()))
    st = state("ban", SamplingParams(extra_args={"ban_prompt": True}), prompt=[3, 30, 300], output=[8])
    batch.add_request(st)
    batch.refresh()
    logits = torch.randn(2, VOCAB)
    out = adapter.apply(logits.clone())
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1, [3, 30, 300]]).all() and torch.isfinite(out[1]).sum() == VOCAB - 3
    st.output_token_ids.append(9)  # the callable sees the live output list
    adapter.apply(logits.clone())
    assert adapter.calls == [([3, 30, 300], [8]), ([3, 30, 300], [8, 9])]


# ---- processors written for vLLM ----------------------------------------------------------------
class VllmWritten(LogitsProcessor):
    """Shaped like vLLM's docs' examples: keyword super().__init__ and the config calls they use."""

    def __init__(self, vllm_config, device, is_pin_memory):
        super().__init__(vllm_config=vllm_config, device=device, is_pin_memory=is_pin_memory)
        self.vocab_size = vllm_config.model_config.get_vocab_size()
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.rows: dict[int, int] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update):
        process_dict_updates(self.rows, batch_update,
                             lambda p, _prompt, _out: (p.extra_args or {}).get("ban_below"))

    def apply(self, logits):
        for row, limit in self.rows.items():
            logits[row, :limit] = -math.inf
        return logits


class ConfigKeyword(AdapterLogitsProcessor):
    def __init__(self, config, device, is_pin_memory):
        super().__init__(config=config, device=device, is_pin_memory=is_pin_memory)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params):
        return None


def test_vllm_written_processors_run(tiny_llama_dir):
    cfg = EngineConfig.create(model=tiny_llama_dir, max_num_seqs=7).finalize()
    procs = build_logitsprocs(cfg, "cpu", False, custom=[VllmWritten, ConfigKeyword])
    custom = [p for p in procs.non_argmax_invariant if isinstance(p, VllmWritten)][0]
    assert (custom.vocab_size, custom.max_num_seqs) == (49152, 7)
    batch = InputBatch(4, 49152, "cpu", procs)
    batch.add_request(state("a", SamplingParams(temperature=0, extra_args={"ban_below": 40000})))
    batch.add_request(state("b", SamplingParams(temperature=0)))
    logits = torch.zeros(2, 49152)
    logits[:, 7] = 5.0
    out = Sampler()(logits, batch.refresh()).sampled_token_ids.tolist()
    assert out[1] == 7 and out[0] >= 40000
