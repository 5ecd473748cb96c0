"""The KV tier (cluster/kv_tier.py, docs/kv_tier.md): the store's files (round trip, checksums,
foreign and temporary files, budgets, shared memory spilling to disk, two writers), then the engine
on the tiny random model (fp32) with a pool too small for its conversations: outputs equal with the
tier on and off (tokens, and logprobs, which the random model's greedy tokens hardly show), through
preemption, chunked prefill, n-gram speculation, async scheduling and LoRA; a restarted copy finds
the first one's prefixes; a file lost or corrupted between admission and read is computed instead."""
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from cluster import LLM, SamplingParams
from cluster.engine.tier_planner import TierPlanner
from cluster.kv_tier import TierStore, file_name
from cluster.messages import KVTierCounters, StepResult
from cluster.lora.adapter import LoRARequest

NS = bytes(range(16))


def _store(tmp_path, shm_budget=1 << 20, disk_budget=None, ns=NS, **kw) -> TierStore:
    levels = [(tmp_path / "shm", shm_budget)]
    if disk_budget is not None:
        levels.append((tmp_path / "disk", disk_budget))
    return TierStore(levels, ns, **kw)


def _payload(seed: int, size: int = 4096) -> bytes:
    return bytes((seed * 31 + i) % 251 for i in range(size))


TOKENS = list(range(100, 116))


# ---- the store ------------------------------------------------------------------------------
def test_round_trip_and_contains(tmp_path):
    store = _store(tmp_path)
    assert not store.contains(7) and store.read(7, TOKENS) is None
    assert store.write(7, TOKENS, _payload(1))
    assert store.contains(7)
    assert bytes(store.read(7, TOKENS)) == _payload(1)
    assert not store.write(7, TOKENS, _payload(1))  # already there: skipped
    c = store.snapshot()
    assert c.blocks_written == 1 and c.bytes_written > 4096 and c.bytes_read == c.bytes_written
    assert c.corrupt_files == 0


def test_every_rank_must_hold_its_file(tmp_path):
    ranks = [_store(tmp_path, world_size=2, rank=r) for r in range(2)]
    ranks[0].write(9, TOKENS, _payload(0))
    assert not ranks[0].contains(9)  # rank 1's heads are missing
    ranks[1].write(9, TOKENS, _payload(1))
    assert ranks[0].contains(9) and ranks[1].contains(9)
    assert bytes(ranks[1].read(9, TOKENS)) == _payload(1)  # each rank its own heads
    assert bytes(ranks[0].read(9, TOKENS)) == _payload(0)


@pytest.mark.parametrize("damage", ["flip_payload", "flip_header", "truncate", "empty", "tokens"])
def test_a_corrupt_file_is_skipped_counted_and_removed(tmp_path, damage):
    store = _store(tmp_path)
    store.write(5, TOKENS, _payload(2))
    path = store.levels[0].path / file_name(5, 0)
    data = bytearray(path.read_bytes())
    if damage == "flip_payload":
        data[-100] ^= 1
    elif damage == "flip_header":
        data[40] ^= 1
    elif damage == "truncate":
        data = data[:-9]
    elif damage == "empty":
        data = bytearray()
    path.write_bytes(bytes(data))
    asked = [t + 1 for t in TOKENS] if damage == "tokens" else TOKENS  # the right hash, other tokens
    assert store.read(5, asked) is None
    assert store.snapshot().corrupt_files == 1 and not path.exists()


def test_a_foreign_namespace_is_never_read(tmp_path):
    mine, other = _store(tmp_path), _store(tmp_path, ns=bytes(16))
    other.write(3, TOKENS, _payload(3))
    assert not mine.contains(3) and mine.read(3, TOKENS) is None  # another folder altogether
    # A foreign file under our name (copied in by hand) fails its header check.
    src = other.levels[0].path / file_name(3, 0)
    (mine.levels[0].path / file_name(3, 0)).write_bytes(src.read_bytes())
    assert mine.read(3, TOKENS) is None and mine.snapshot().corrupt_files == 1
    # So does a file of another rank or TP size.
    _store(tmp_path, world_size=2, rank=1).write(4, TOKENS, _payload(4))
    wrong = _store(tmp_path, world_size=2, rank=1).levels[0].path / file_name(4, 1)
    (mine.levels[0].path / file_name(4, 0)).write_bytes(wrong.read_bytes())
    assert mine.read(4, TOKENS) is None


def test_temporary_files_are_never_read_and_stale_ones_are_swept(tmp_path):
    store = _store(tmp_path, shm_budget=10 << 10)
    name = file_name(11, 0)
    tmp = store.levels[0].path / f".{name}.123.456.tmp"
    tmp.write_bytes(b"half a block")
    assert not store.contains(11) and store.read(11, TOKENS) is None
    old = time.time() - 3600
    os.utime(tmp, (old, old))
    store.shrink(0)
    assert not tmp.exists()


def _file_size(tmp_path) -> int:
    probe = _store(tmp_path / "probe")
    probe.write(0, TOKENS, _payload(0))
    return (probe.levels[0].path / file_name(0, 0)).stat().st_size


def test_budget_evicts_least_recently_used(tmp_path):
    one = _file_size(tmp_path)
    store = _store(tmp_path, shm_budget=3 * one + 100)
    for h in range(3):
        store.write(h, TOKENS, _payload(h))
        _age(store, h, 100 - h)
    store.read(0, TOKENS)  # the oldest becomes the most recent
    store.write(3, TOKENS, _payload(3))
    store.write(4, TOKENS, _payload(4))
    held = {h for h in range(5) if store.contains(h)}
    assert 0 in held and 1 not in held and {3, 4} <= held
    assert store.snapshot().evictions >= 1
    assert sum(f.stat().st_size for f in store.levels[0].path.iterdir()) <= 3 * one


def test_shared_memory_spills_to_disk(tmp_path):
    one = _file_size(tmp_path)
    store = _store(tmp_path, shm_budget=2 * one, disk_budget=100 * one)
    for h in range(6):
        store.write(h, TOKENS, _payload(h))
        _age(store, h, 100 - h)
    c = store.snapshot()
    assert c.spills >= 3 and c.evictions == 0
    on_disk = {h for h in range(6) if (store.levels[1].path / file_name(h, 0)).exists()}
    assert 0 in on_disk and all(store.contains(h) for h in range(6))
    assert bytes(store.read(0, TOKENS)) == _payload(0)  # read from disk
    # A restarted copy (a new handle) sees both levels.
    again = _store(tmp_path, shm_budget=2 * one, disk_budget=100 * one)
    assert all(again.contains(h) for h in range(6))


def test_two_writers_of_one_block_are_harmless(tmp_path):
    stores = [_store(tmp_path) for _ in range(4)]
    barrier = threading.Barrier(4)

    def write(s):
        barrier.wait()
        for h in range(20):
            s.write(h, TOKENS, _payload(h))

    threads = [threading.Thread(target=write, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    reader = _store(tmp_path)
    assert all(bytes(reader.read(h, TOKENS)) == _payload(h) for h in range(20))
    assert reader.snapshot().corrupt_files == 0
    assert not [f for f in reader.levels[0].path.iterdir() if f.name.endswith(".tmp")]


def test_routing_keys_list_whole_blocks_newest_first_and_move_only_on_change(tmp_path, monkeypatch):
    from cluster import kv_tier

    ranks = [_store(tmp_path, disk_budget=1 << 20, world_size=2, rank=r) for r in range(2)]
    a, b, c = (1 << 64) | 5, (2 << 64) | 7, (3 << 64) | 9  # routing keys: the low 64 bits
    for i, h in enumerate((a, b, c)):
        ranks[0].write(h, TOKENS, _payload(i))
    for i, h in enumerate((a, b)):
        ranks[1].write(h, TOKENS, _payload(i))
    for h, seconds_ago in ((a, 30), (b, 60)):
        t = time.time() - seconds_ago
        for r in range(2):
            os.utime(ranks[0].levels[0].path / file_name(h, r), (t, t))
    version, keys = ranks[0].relist()
    assert keys == [5, 7]  # c lacks rank 1's file
    assert ranks[0].relist() == (version, keys)
    ranks[1].write(c, TOKENS, _payload(2))  # another process's write: seen at the next listing
    version2, keys = ranks[0].relist()
    assert version2 > version and keys == [9, 5, 7]
    shm, disk = (level.path for level in ranks[0].levels)
    shutil.copy(shm / file_name(c, 0), disk / file_name(c, 0))
    (shm / file_name(c, 1)).unlink()  # c: rank 0's file twice (both levels), rank 1's gone
    assert ranks[0].relist()[1] == [5, 7]
    # routing_keys answers the last listing at once and lists again in the background, at most
    # every LIST_PERIOD_S.
    other = _store(tmp_path, disk_budget=1 << 20, world_size=2)
    monkeypatch.setattr(kv_tier, "LIST_PERIOD_S", 3600.0)
    assert other.routing_keys() == (0, [])  # never listed: a background listing starts
    deadline = time.monotonic() + 30
    while other.routing_keys(limit=1) != (1, [5]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert other.routing_keys() == (1, [5, 7])
    ranks[1].write(c, TOKENS, _payload(2))
    time.sleep(0.2)
    assert other.routing_keys() == (1, [5, 7])  # listed less than an hour ago


def test_the_planner_holds_a_store_whose_writes_are_not_read_back(tmp_path):
    """The planner (cluster/engine/tier_planner.py) on a real store of 10 blocks: a turnover
    (10 new blocks) written with nothing read back makes the next one hold (no saves); holding
    goes on while the kept blocks are read back (1 in 8 or more) and ends when they are not; a
    turnover read back enough while writing goes on writing."""
    store = _store(tmp_path)
    planner = TierPlanner(store, block_size=16)
    file_bytes = len(_payload(0)) + 200  # what a rank reports per block
    store.levels[0].budget = 10 * file_bytes

    def step(first: int, n: int) -> list:
        return planner.saves([(b, first + b, tuple(TOKENS)) for b in range(n)])

    def read_back(blocks: int) -> None:
        load = planner.load("r", 0, list(range(blocks)), [(h, tuple(TOKENS), 0) for h in range(blocks)])
        planner.reported(StepResult(0, [], [], kv_loaded=[load.load_id]))

    assert len(step(0, 10)) == 10 and not planner.holding  # no capacity known before a rank reports
    planner.reported(StepResult(0, [], [], kv_tier=KVTierCounters(bytes_written=10 * file_bytes, blocks_written=10)))
    assert planner.capacity == 10
    assert len(step(100, 10)) == 10 and planner.holding  # a turnover written, nothing read back
    assert step(200, 4) == [] and planner.writes_held == 4
    read_back(2)  # 2 of 10 held blocks read back: the kept contents pay
    assert step(300, 6) == [] and planner.holding and planner.writes_held == 10
    assert step(400, 10) == [] and not planner.holding  # nothing read back: write again
    assert len(step(500, 5)) == 5
    read_back(2)
    assert len(step(600, 5)) == 5 and not planner.holding  # 2 of 10 read back while writing: go on
    assert planner.hit_tokens == 4 * 16


def _age(store: TierStore, h: int, seconds_ago: float) -> None:
    t = time.time() - seconds_ago
    for level in store.levels:
        path = level.path / file_name(h, 0)
        if path.exists():
            os.utime(path, (t, t))


# ---- the engine ---------------------------------------------------------------------------------
# 24 blocks of 16 tokens hold about two of the conversations below; each runs 4 turns whose
# histories grow to ~300 tokens, so the pool evicts what the next turn needs.
BASE = dict(dtype="float32", max_model_len=512, num_kv_blocks=24, seed=0)
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)


def _tier(tmp_path, **kw) -> dict:
    return dict(kv_offloading_size=0.01, kv_offloading_shm_path=str(tmp_path / "shm"), **kw)


def _user(conv: int, turn: int, n: int = 30) -> list[int]:
    # Repeats within a turn, so n-gram speculation has something to propose.
    period = [(97 * conv + 13 * turn + 7 * j) % 30000 + 600 for j in range(6)]
    return (period * (n // 6 + 1))[:n]


def _chat(llm: LLM, num_convs: int = 4, turns: int = 4, loras=None, first: int = 40) -> list:
    """Conversations in lockstep, every turn's answer appended to its history: (tokens, logprobs)
    of every answer. The tier's writes are waited for between turns (they are asynchronous)."""
    loras = loras or [None] * num_convs
    histories = [_user(c if loras[c] is None else 0, 0, first) for c in range(num_convs)]
    outs = []
    for turn in range(turns):
        results = llm.generate([{"prompt_token_ids": h} for h in histories], PARAMS, use_tqdm=False,
                               lora_request=loras if any(loras) else None)
        for c, r in enumerate(results):
            done = r.outputs[0]
            outs.append((done.token_ids, [next(iter(p.values())).logprob for p in done.logprobs]))
            histories[c] = histories[c] + done.token_ids + _user(c if loras[c] is None else 0, turn + 1)
        _flush(llm)
    return outs


def _flush(llm: LLM) -> None:
    offload = llm.engine.executor.worker.runner.kv_offload
    if offload is not None:
        offload.flush()


def _written(llm: LLM) -> int:
    """Blocks the worker wrote, counted there (the engine hears of writes with later steps)."""
    _flush(llm)
    return llm.engine.executor.worker.runner.kv_offload.store.snapshot().blocks_written


def _same(got: list, want: list) -> None:
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, a), (_, b) in zip(got, want):  # loaded KV is the KV computed earlier: fp32 noise at most
        assert a == pytest.approx(b, abs=1e-4)


def _idle(llm: LLM) -> None:
    stats = llm.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.parametrize("variant", [
    dict(),
    dict(num_kv_blocks=14),  # conversations preempt each other
    dict(max_num_batched_tokens=32),  # chunked prefill, loads beside running chunks
    dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}),
    dict(async_scheduling=True, max_num_batched_tokens=64),
], ids=["small-pool", "preempting", "chunked", "ngram-spec", "async"])
def test_outputs_equal_with_the_tier_on_and_off(tiny_llama_dir, tmp_path, variant):
    want = _chat(LLM(tiny_llama_dir, **{**BASE, **variant}))
    llm = LLM(tiny_llama_dir, **{**BASE, **variant}, **_tier(tmp_path))
    got = _chat(llm)
    _same(got, want)
    stats = llm.engine.stats()
    assert stats.kv_tier_hit_tokens > 0 and stats.kv_tier_load_failures == 0
    assert stats.kv_tier_blocks_written > 0 and stats.kv_tier_bytes_read > 0
    assert stats.kv_tier_corrupt_files == 0
    if "num_kv_blocks" in variant:
        assert stats.preemptions > 0
    if "speculative_config" in variant:
        assert stats.spec_decode_num_accepted_tokens > 0
    _idle(llm)


def test_shared_memory_spills_to_disk_under_the_engine(tiny_llama_dir, tmp_path):
    want = _chat(LLM(tiny_llama_dir, **BASE))
    # 40 KiB of shared memory: a few blocks of the tiny model (8 KiB each); the rest on disk.
    llm = LLM(tiny_llama_dir, **BASE, kv_offloading_size=40 / 2**20, kv_offloading_shm_path=str(tmp_path / "shm"),
              kv_offloading_disk_path=str(tmp_path / "disk"), kv_offloading_disk_size=0.01)
    _same(_chat(llm), want)
    stats = llm.engine.stats()
    assert stats.kv_tier_spills > 0 and stats.kv_tier_hit_tokens > 0 and stats.kv_tier_evictions == 0


def test_blocks_on_disk_are_copied_up_to_shared_memory_before_their_read(tiny_llama_dir, tmp_path):
    prompt = {"prompt_token_ids": _user(6, 0, 60)}
    levels = dict(kv_offloading_size=0.01, kv_offloading_shm_path=str(tmp_path / "shm"),
                  kv_offloading_disk_path=str(tmp_path / "disk"), kv_offloading_disk_size=0.01)
    first = LLM(tiny_llama_dir, **BASE, **levels)
    want = first.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0]
    _flush(first)
    for f in (tmp_path / "shm").rglob("*.kv"):  # as if spilled: on disk only
        target = tmp_path / "disk" / f.relative_to(tmp_path / "shm")
        target.parent.mkdir(parents=True, exist_ok=True)
        f.rename(target)
    llm = LLM(tiny_llama_dir, **BASE, **levels)
    steps = _record_steps(llm)
    got = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.token_ids and got.num_cached_tokens == 48
    stats = llm.engine.stats()
    assert stats.kv_tier_promotions == 3 and stats.kv_tier_hit_tokens == 48
    assert len(list((tmp_path / "shm").rglob("*.kv"))) >= 3  # read from shared memory
    assert len(list((tmp_path / "disk").rglob("*.kv"))) >= 3  # the disk copies stay
    assert [s for s in steps if s[1]] == [steps[0]]  # it started in the first step, with its read


def test_disk_alone(tiny_llama_dir, tmp_path):
    want = _chat(LLM(tiny_llama_dir, **BASE))
    llm = LLM(tiny_llama_dir, **BASE, kv_offloading_disk_path=str(tmp_path / "disk"), kv_offloading_disk_size=0.01,
              kv_offloading_shm_path=str(tmp_path / "shm"))
    _same(_chat(llm), want)
    assert llm.engine.stats().kv_tier_hit_tokens > 0
    assert not (tmp_path / "shm").exists()  # no shared-memory level without kv_offloading_size
    assert list((tmp_path / "disk").rglob("*.kv"))


def test_a_restarted_copy_finds_the_first_ones_prefixes(tiny_llama_dir, tmp_path):
    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    _chat(first, turns=2)
    prompt = {"prompt_token_ids": _user(1, 0, 40)}
    want = LLM(tiny_llama_dir, **BASE).generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0]
    again = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))  # a new copy on the same node
    got = again.generate(prompt, PARAMS, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids
    stats = again.engine.stats()
    assert stats.kv_tier_hit_tokens == 32  # 40 tokens: two full blocks, the last token computed
    assert stats.prefix_cache_hits == 32 and _written(again) == 0  # its blocks were all there
    # Another block size is another namespace: nothing of the first copy's is read.
    other = LLM(tiny_llama_dir, **{**BASE, "block_size": 8}, **_tier(tmp_path))
    other.generate(prompt, PARAMS, use_tqdm=False)
    assert other.engine.stats().kv_tier_hit_tokens == 0


def test_a_restarted_copy_reports_the_tier_to_the_router_which_sends_it_the_conversation(tiny_llama_dir, tmp_path):
    """What the router learns of the tier: a copy that served nothing yet reports the blocks the
    first copy left in the store, so the prompt goes to it rather than to a copy elsewhere."""
    from cluster.prefix_hash import prompt_routing_keys
    from cluster.routing import TIER_HIT, PrefixAffinityPolicy

    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    prompt = _user(1, 0, 40)
    first.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    _flush(first)
    keys = prompt_routing_keys(prompt, 16)
    assert len(keys) == 2
    again = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    deadline = time.monotonic() + 30  # the store is listed in the background (a router asks every second)
    while not (summary := again.engine.prefix_cache_summary()).tier_keys and time.monotonic() < deadline:
        time.sleep(0.05)
    assert summary.keys == [] and set(keys) <= set(summary.tier_keys)
    elsewhere = LLM(tiny_llama_dir, **BASE).engine.prefix_cache_summary()  # no tier
    assert elsewhere.tier_keys == []
    policy = PrefixAffinityPolicy(16)
    policy.report("again", summary)
    policy.report("elsewhere", elsewhere)
    decision = policy.choose(keys, {"again": 1, "elsewhere": 0})
    assert (decision.replica, decision.reason, decision.tier_blocks) == ("again", TIER_HIT, 2)
    again.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    assert again.engine.stats().kv_tier_hit_tokens == 32


@pytest.mark.parametrize("damage", ["deleted", "corrupted"])
def test_a_file_lost_between_admission_and_read_is_computed_instead(tiny_llama_dir, tmp_path, damage):
    from cluster.messages import StepPlan, decode

    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    prompts = [{"prompt_token_ids": _user(c, 0, 60)} for c in range(2)]
    first.generate(prompts, PARAMS, use_tqdm=False)
    _flush(first)
    want = [o.outputs[0] for o in LLM(tiny_llama_dir, **BASE).generate(prompts, PARAMS, use_tqdm=False)]
    llm = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    store = llm.engine.scheduler.tier.store
    submit, hit = llm.engine.executor.submit, []

    def damaging_submit(plan_bytes):
        plan = decode(plan_bytes, StepPlan)
        if plan.kv_loads and not hit:  # admitted: the engine saw the files; now one goes bad
            block = plan.kv_loads[0].blocks[1]
            path = store._find(file_name(int.from_bytes(block.chain_hash, "little"), 0))
            if damage == "deleted":
                path.unlink()
            else:
                data = bytearray(path.read_bytes())
                data[-20] ^= 0xFF
                path.write_bytes(bytes(data))
            hit.append(plan.kv_loads[0].load_id)
        return submit(plan_bytes)

    llm.engine.executor.submit = damaging_submit
    got = [o.outputs[0] for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    assert hit
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert [next(iter(p.values())).logprob for p in g.logprobs] == \
            pytest.approx([next(iter(p.values())).logprob for p in w.logprobs], abs=1e-4)
    stats = llm.engine.stats()
    assert stats.kv_tier_load_failures == 1
    assert stats.kv_tier_corrupt_files == (damage == "corrupted")
    assert stats.kv_tier_hit_tokens == 48  # the other prompt's three blocks
    _idle(llm)


def test_lora_adapters_keep_their_blocks_apart(tiny_llama_dir, lora_adapters, tmp_path):
    lora = dict(enable_lora=True, max_loras=2, max_lora_rank=16, lora_modules=lora_adapters)
    loras = [LoRARequest("sql"), LoRARequest("chat"), None]  # the same tokens under each
    want = _chat(LLM(tiny_llama_dir, **BASE, **lora), num_convs=3, loras=loras)
    llm = LLM(tiny_llama_dir, **BASE, **lora, **_tier(tmp_path))
    got = _chat(llm, num_convs=3, loras=loras)
    _same(got, want)
    assert got[0][1] != pytest.approx(got[1][1], abs=1e-3)  # the adapters matter
    stats = llm.engine.stats()
    assert stats.kv_tier_hit_tokens > 0
    # Three copies of every block were written: one per adapter (and the base model).
    first_turn_blocks = (40 - 1) // 16
    files = list((tmp_path / "shm").rglob("*.kv"))
    assert len(files) == _written(llm) >= 3 * first_turn_blocks and len(files) % 3 == 0


def test_options_are_checked(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="kv_offloading_disk_path and kv_offloading_disk_size"):
        LLM(tiny_llama_dir, **BASE, kv_offloading_disk_path=str(tmp_path))
    with pytest.raises(ValueError, match="enable_prefix_caching=True"):
        LLM(tiny_llama_dir, **BASE, enable_prefix_caching=False, **_tier(tmp_path))
    with pytest.raises(ValueError, match="kv_offloading_size must be greater than 0"):
        LLM(tiny_llama_dir, **BASE, kv_offloading_size=0)
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ValueError, match="kv_offloading_shm_path=.*a-file/shm.*cannot use this folder"):
        LLM(tiny_llama_dir, **BASE, kv_offloading_size=1, kv_offloading_shm_path=str(tmp_path / "a-file" / "shm"))


def test_the_warm_up_writes_nothing_to_the_tier(tiny_llama_dir, tmp_path):
    llm = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    llm.engine.warm_up()
    _flush(llm)
    assert not list((tmp_path / "shm").rglob("*.kv"))
    llm.generate({"prompt_token_ids": _user(0, 0, 40)}, PARAMS, use_tqdm=False)
    _flush(llm)
    assert len(list((tmp_path / "shm").rglob("*.kv"))) == _written(llm) == 3  # 50 tokens: outputs too


def _one_at_a_time(llm: LLM, num_convs: int, turns: int) -> list:
    """Conversations taking turns one after the other, so each one's next turn comes after
    every other's: (tokens, logprobs) of every answer."""
    histories = [_user(c, 0, 40) for c in range(num_convs)]
    outs = []
    for turn in range(turns):
        for c in range(num_convs):
            done = llm.generate({"prompt_token_ids": histories[c]}, PARAMS, use_tqdm=False)[0].outputs[0]
            outs.append((done.token_ids, [next(iter(p.values())).logprob for p in done.logprobs]))
            histories[c] = histories[c] + done.token_ids + _user(c, turn + 1)
            _flush(llm)
    return outs


def test_a_store_too_small_for_its_conversations_holds_what_it_has(tiny_llama_dir, tmp_path):
    """Six conversations of up to 15 blocks each cycling through a store of 24 blocks: under LRU
    alone each one's blocks are evicted before its next turn (the store read back 112 tokens of
    the 4,832 written). The planner holds the store's contents after a turnover that was not read
    back, and the conversations it kept read their histories from it turn after turn."""
    want = _one_at_a_time(LLM(tiny_llama_dir, **BASE), 6, 6)
    llm = LLM(tiny_llama_dir, **BASE, kv_offloading_size=200 / 2**20, kv_offloading_shm_path=str(tmp_path / "shm"))
    _same(_one_at_a_time(llm, 6, 6), want)
    stats = llm.engine.stats()
    assert llm.engine.scheduler.tier.capacity == 24 and stats.kv_tier_writes_held > 0
    assert stats.kv_tier_hit_tokens > 16 * stats.kv_tier_blocks_written  # read back more than it was written
    assert stats.kv_tier_load_failures == 0
    _idle(llm)


# ---- tensor parallel: each rank its own heads' files ---------------------------------------------
def _tp_rank(rank: int, world: int, config, folder: str, plans, results) -> None:
    """One TP rank in its own process: runs the plans it is sent (rank 0 answers); "flush" waits
    for its tier writes. Torn down as tests/test_model.py's ranks are (gloo aborts otherwise)."""
    import sys

    import torch

    from cluster.worker.worker import Worker

    torch.set_num_threads(1)
    try:
        worker = Worker(config, rank, world, f"file://{folder}/store")
        if rank == 0:
            results.put(worker.num_kv_blocks)
        while (msg := plans.get()) is not None:
            if msg == "flush":
                if worker.runner.kv_offload is not None:
                    worker.runner.kv_offload.flush()
                out = b"flushed"
            else:
                out = worker.execute(msg)
            if rank == 0:
                results.put(out)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # the test fails with it instead of waiting for its queue
        results.put(RuntimeError(f"rank {rank}: {exc!r}"))
    Path(folder, f"done-{rank}").touch()
    deadline = time.monotonic() + 60
    while not all(Path(folder, f"done-{r}").exists() for r in range(world)) and time.monotonic() < deadline:
        time.sleep(0.01)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _TPExecutor:
    """The engine's executor over `world` rank processes (the Ray executor's shape, without Ray)."""

    def __init__(self, config, world: int, folder: Path, lose_rank: int | None = None) -> None:
        from rank_processes import context

        self.store, self.lose_rank = TierStore.from_config(config), lose_rank  # lose: see submit
        ctx = context()
        folder.mkdir()
        self.plans, self.results = [ctx.Queue() for _ in range(world)], ctx.Queue()
        self.procs = [ctx.Process(target=_tp_rank, args=(r, world, config, str(folder), self.plans[r], self.results))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.num_kv_blocks = self._answer()

    def _answer(self):
        out = self.results.get(timeout=300)
        if isinstance(out, BaseException):
            raise out
        return out

    def submit(self, plan_bytes: bytes):
        from concurrent.futures import Future

        from cluster.messages import StepPlan, decode

        plan = decode(plan_bytes, StepPlan)
        if self.lose_rank is not None and plan.kv_loads:  # one rank's file gone after admission
            h = int.from_bytes(plan.kv_loads[0].blocks[0].chain_hash, "little")
            self.store._find(file_name(h, self.lose_rank)).unlink()
            self.lose_rank = None
        for q in self.plans:
            q.put(plan_bytes)
        done = Future()
        done.set_result(self._answer())
        return done

    def flush(self) -> None:
        for q in self.plans:
            q.put("flush")
        assert self._answer() == b"flushed"

    def close(self) -> None:
        for q in self.plans:
            q.put(None)
        for p in self.procs:
            p.join(120)


def _tp_chat(tiny_llama_dir, tmp_path, name: str, world: int, lose_rank: int | None = None,
             **options) -> tuple[list, object]:
    from cluster.config import EngineConfig
    from cluster.engine.engine_core import EngineCore
    from cluster.messages import EngineRequest

    config = EngineConfig.create(model=tiny_llama_dir, tensor_parallel_size=world, **BASE, **options).finalize()
    executor = _TPExecutor(config, world, tmp_path / name, lose_rank)
    try:
        core = EngineCore(config, executor)
        histories, outs = [_user(c, 0, 40) for c in range(4)], []
        for turn in range(4):
            for c, h in enumerate(histories):
                core.add_request(EngineRequest(f"{turn}-{c}", h, PARAMS))
            got = {}
            while core.has_unfinished():
                for o in core.step():
                    tokens, lps = got.setdefault(o.request_id, ([], []))
                    tokens += o.new_token_ids
                    lps += [row[0] for row in o.new_logprobs.logprobs] if o.new_logprobs else []
            for c in range(4):
                outs.append(got[f"{turn}-{c}"])
                histories[c] = histories[c] + got[f"{turn}-{c}"][0] + _user(c, turn + 1)
            executor.flush()
        return outs, core.stats()
    finally:
        executor.close()


def _hashes_by_rank(folder: Path, world: int) -> list[set[str]]:
    """The chain hashes of the block files each rank wrote under `folder`."""
    files = list(folder.rglob("*.kv"))
    return [{f.name.split(".")[0] for f in files if f.name.endswith(f".{r}.kv")} for r in range(world)]


def test_tensor_parallel_ranks_store_and_read_their_own_heads(tiny_llama_dir, tmp_path):
    want, _ = _tp_chat(tiny_llama_dir, tmp_path, "off", 2)
    got, stats = _tp_chat(tiny_llama_dir, tmp_path, "on", 2, **_tier(tmp_path))
    _same(got, want)
    assert stats.kv_tier_hit_tokens > 0 and stats.kv_tier_load_failures == 0
    by_rank = _hashes_by_rank(tmp_path / "shm", 2)
    assert by_rank[0] and by_rank[0] == by_rank[1]  # every block: one file per rank
    sizes = {f.stat().st_size for f in (tmp_path / "shm").rglob("*.kv")}
    single = LLM(tiny_llama_dir, **BASE, kv_offloading_size=0.01, kv_offloading_shm_path=str(tmp_path / "tp1"))
    single.generate({"prompt_token_ids": _user(0, 0, 40)}, PARAMS, use_tqdm=False)
    _flush(single)
    (one,) = {f.stat().st_size for f in (tmp_path / "tp1").rglob("*.kv")}
    assert len(sizes) == 1 and sizes.pop() < one  # half the heads (1 of 2 KV heads) per rank
    # A restarted copy whose rank 1 loses a file after admission: rank 0 read its own, yet the
    # ranks agree the read failed, and the blocks are computed.
    again, stats = _tp_chat(tiny_llama_dir, tmp_path, "lost", 2, lose_rank=1, **_tier(tmp_path))
    _same(again, want)
    assert stats.kv_tier_load_failures == 1 and stats.kv_tier_hit_tokens > 0


def test_three_ranks_store_their_own_heads_and_answer_as_without_the_tier(three_kv_heads_dir, tmp_path):
    want, _ = _tp_chat(three_kv_heads_dir, tmp_path, "off", 3)
    got, stats = _tp_chat(three_kv_heads_dir, tmp_path, "on", 3, **_tier(tmp_path))
    _same(got, want)
    assert stats.kv_tier_hit_tokens > 0 and stats.kv_tier_load_failures == 0
    by_rank = _hashes_by_rank(tmp_path / "shm", 3)
    assert by_rank[0] and by_rank[0] == by_rank[1] == by_rank[2]  # every block: one file per rank


def test_prompts_sharing_a_prefix_read_it_once(tiny_llama_dir, tmp_path):
    shared = _user(5, 0, 64)
    prompts = [{"prompt_token_ids": shared + _user(c, 1, 20)} for c in range(3)]
    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    first.generate(prompts[:1], PARAMS, use_tqdm=False)
    _flush(first)
    want = LLM(tiny_llama_dir, **BASE).generate(prompts, PARAMS, use_tqdm=False)
    again = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    got = again.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    stats = again.engine.stats()
    # The first prompt's 5 blocks read once; the others wait for that read and hit 4 of them.
    assert stats.kv_tier_hit_tokens == 80
    size = next((tmp_path / "shm").rglob("*.kv")).stat().st_size
    assert stats.kv_tier_bytes_read == 5 * size
    assert [o.num_cached_tokens for o in got] == [80, 64, 64]


def _slow_reads(llm: LLM, seconds: float) -> None:
    store = llm.engine.executor.worker.runner.kv_offload.store
    read = store.read

    def slow(*args):
        time.sleep(seconds)
        return read(*args)

    store.read = slow


def _record_steps(llm: LLM) -> list:
    """(step, load ids planned, load ids reported loaded, requests scheduled) of every step."""
    from cluster.messages import StepPlan, StepResult, decode

    steps, submit = [], llm.engine.executor.submit

    def recording(plan_bytes):
        plan, fut = decode(plan_bytes, StepPlan), submit(plan_bytes)
        res = decode(fut.result(), StepResult)
        steps.append((plan.step, [ld.load_id for ld in plan.kv_loads], res.kv_loaded, list(plan.num_scheduled_tokens)))
        return fut

    llm.engine.executor.submit = recording
    return steps


def test_a_tier_hit_starts_in_the_step_that_reads_it(tiny_llama_dir, tmp_path):
    from cluster.messages import EngineRequest

    prompt = _user(3, 0, 60)
    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    first.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    _flush(first)
    want = LLM(tiny_llama_dir, **BASE).generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0].outputs[0]
    llm = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    _slow_reads(llm, 0.05)
    steps = _record_steps(llm)
    core = llm.engine
    core.add_request(EngineRequest("busy", _user(9, 0, 20), SamplingParams(temperature=0, max_tokens=40)))
    core.step()
    core.add_request(EngineRequest("tier", prompt, PARAMS))
    got, first_step = [], None
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == "tier":
                first_step = first_step or steps[-1][0]
                got += out.new_token_ids
    assert got == want.token_ids
    step, loads, loaded, scheduled = next(s for s in steps if s[1])
    # Read, the rest of the prompt computed and the first token sampled in one step, beside "busy".
    assert first_step == step and loaded == loads and sorted(scheduled) == ["busy", "tier"]
    assert core.stats().kv_tier_hit_tokens == 48


def test_a_request_aborted_in_the_step_that_reads_for_it_leaves_nothing_held(tiny_llama_dir, tmp_path):
    from cluster.messages import EngineRequest, StepPlan, decode

    prompt = _user(4, 0, 60)
    first = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    first.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)
    _flush(first)
    llm = LLM(tiny_llama_dir, **BASE, **_tier(tmp_path))
    core = llm.engine
    submit, aborted = core.executor.submit, []

    def abort_once_read(plan_bytes):
        fut = submit(plan_bytes)
        if decode(plan_bytes, StepPlan).kv_loads and not aborted:
            core.abort("tier")  # while the workers read for it
            aborted.append(True)
        return fut

    core.executor.submit = abort_once_read
    core.add_request(EngineRequest("tier", prompt, PARAMS))
    while core.has_unfinished():
        core.step()
    assert aborted
    _idle(llm)
    assert core.stats().kv_tier_hit_tokens == 48  # the read was done, and counted
    # What was read is good: the next request for it hits the pool.
    again = llm.generate({"prompt_token_ids": prompt}, PARAMS, use_tqdm=False)[0]
    assert again.num_cached_tokens == 48
