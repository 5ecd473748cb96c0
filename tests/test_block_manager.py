"""Block manager: a stateful model check against a shadow KV cache, plus targeted cases."""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from cluster import prefix_hash
from cluster.engine.block_manager import BlockManager
from cluster.prefix_hash import hash_block_tokens
from cluster.errors import EngineInternalError


def snapshot(bm: BlockManager) -> tuple:
    return (list(bm.free_queue), dict(bm.cached), [dataclasses.astuple(b) for b in bm.blocks],
            {r: dataclasses.astuple(s) for r, s in bm.requests.items()},
            bm.prefix_cache_queries, bm.prefix_cache_hits)


def admit(bm: BlockManager, rid: str, tokens: list[int], num_new: int | None = None) -> list[int] | None:
    """What the scheduler does for a waiting request: look up the cache, then allocate."""
    hits, num_cached = bm.get_computed_blocks(tokens)
    n = len(tokens) - num_cached if num_new is None else num_new
    return bm.allocate_slots(rid, tokens, num_cached, n, hits)


# ---- stateful model check --------------------------------------------------------------
BS, NUM_BLOCKS, MAX_LEN, MAX_LIVE = 4, 10, 36, 6
TOKENS = st.integers(0, 2)  # a tiny alphabet, so prompts share prefixes and hit the cache


@dataclasses.dataclass
class Live:
    tokens: list[int]
    computed: int
    table: list[int]  # built from allocate_slots' return values only


class BlockManagerMachine(RuleBasedStateMachine):
    caching = True

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=self.caching)
        self.live: dict[str, Live] = {}
        self.waiting: dict[str, list[int]] = {}  # preempted / refused requests, tokens so far
        # Shadow KV: per block, the token sequence whose KV it physically holds (its prefix
        # included, since a token's KV depends on everything before it).
        self.kv: dict[int, tuple[int, ...]] = {}
        self.count = 0

    def _compute(self, req: Live, n: int) -> None:
        """The forward pass: write KV for positions computed .. computed + n - 1."""
        end = req.computed + n
        for j in range(req.computed // BS, -(-end // BS)):
            bid = req.table[j]
            assert self.bm.blocks[bid].ref_count == 1, "wrote into a block someone else holds"
            self.kv[bid] = tuple(req.tokens[:min((j + 1) * BS, end)])
        req.computed = end

    def _admit(self, rid: str, tokens: list[int], chunk: int) -> None:
        hits, num_cached = self.bm.get_computed_blocks(tokens)
        assert num_cached == len(hits) * BS < len(tokens)
        if not self.caching:
            assert hits == []
        event("cache hit" if hits else "cache miss")
        for i, bid in enumerate(hits):  # a hit must hold exactly this prefix's KV
            assert self.kv[bid] == tuple(tokens[:(i + 1) * BS])
            assert self.bm.blocks[bid].token_ids == tuple(tokens[i * BS:(i + 1) * BS])
        n = min(len(tokens) - num_cached, chunk)
        before = snapshot(self.bm)
        got = self.bm.allocate_slots(rid, tokens, num_cached, n, hits)
        if got is None:
            event("admission refused")
            assert snapshot(self.bm) == before
            self.waiting[rid] = tokens
            return
        assert got[:len(hits)] == hits
        self.waiting.pop(rid, None)
        self.live[rid] = req = Live(tokens, num_cached, list(got))
        self._compute(req, n)

    def _preempt(self, rid: str) -> None:
        self.bm.free(rid)
        self.waiting[rid] = self.live.pop(rid).tokens

    @precondition(lambda self: len(self.live) + len(self.waiting) < MAX_LIVE)
    @rule(prompt=st.lists(TOKENS, min_size=1, max_size=24), chunk=st.integers(1, 24))
    def new_request(self, prompt: list[int], chunk: int) -> None:
        self.count += 1
        self._admit(f"r{self.count}", prompt, chunk)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 8), token=TOKENS)
    def step(self, data, chunk: int, token: int) -> None:
        """A prefill chunk, or a decode step with a freshly sampled token."""
        rid = data.draw(st.sampled_from(sorted(self.live)))
        req = self.live[rid]
        if req.computed == len(req.tokens):
            if len(req.tokens) >= MAX_LEN:
                return self.finish_one(rid)
            req.tokens.append(token)
        n = min(len(req.tokens) - req.computed, chunk)
        before = snapshot(self.bm)
        got = self.bm.allocate_slots(rid, req.tokens, req.computed, n)
        if got is None:  # out of blocks: the scheduler preempts
            event("preempted for lack of blocks")
            assert snapshot(self.bm) == before
            return self._preempt(rid)
        req.table += got
        self._compute(req, n)

    def finish_one(self, rid: str) -> None:
        self.bm.free(rid)
        del self.live[rid]

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finish(self, data) -> None:
        self.finish_one(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def preempt_and_resume(self, data, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        self._preempt(rid)
        self._admit(rid, self.waiting[rid], chunk)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 40))
    def resume(self, data, chunk: int) -> None:
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self._admit(rid, self.waiting[rid], chunk)

    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.bm.reset_prefix_cache() == (not self.live)
        if not self.live:
            assert self.bm.cached == {} and all(b.hash is None for b in self.bm.blocks)

    @rule()
    def drain(self) -> None:
        for rid in list(self.live):
            self.finish_one(rid)
        self.waiting.clear()
        assert self.bm.num_free_blocks == NUM_BLOCKS and self.bm.usage == 0.0

    @invariant()
    def blocks_consistent(self) -> None:
        bm = self.bm
        assert set(bm.requests) == set(self.live)
        holders = Counter()
        for rid, req in self.live.items():
            assert bm.block_ids(rid) == req.table
            assert len(set(req.table)) == len(req.table)
            assert len(req.table) == -(-req.computed // BS)
            holders.update(req.table)
        for b in bm.blocks:
            assert b.ref_count == holders[b.id]
            assert (b.id in bm.free_queue) == (b.ref_count == 0)
        referenced = sum(b.ref_count > 0 for b in bm.blocks)
        assert bm.num_free_blocks + referenced == NUM_BLOCKS
        assert bm.usage == pytest.approx(referenced / NUM_BLOCKS)
        for h, bid in bm.cached.items():  # every cache entry describes the KV it points at
            block = bm.blocks[bid]
            assert self.caching and block.hash == h
            assert len(self.kv[bid]) % BS == 0 and self.kv[bid][-BS:] == block.token_ids
        assert 0 <= bm.prefix_cache_hits <= bm.prefix_cache_queries

    def teardown(self) -> None:
        for rid in list(self.live):
            self.bm.free(rid)
        assert self.bm.num_free_blocks == NUM_BLOCKS


class NoCachingMachine(BlockManagerMachine):
    caching = False


_settings = settings(max_examples=200, stateful_step_count=80, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
TestBlockManagerStateful = BlockManagerMachine.TestCase
TestBlockManagerStateful.settings = _settings
TestNoCachingStateful = NoCachingMachine.TestCase
TestNoCachingStateful.settings = settings(_settings, max_examples=40)


# ---- targeted cases --------------------------------------------------------------------
def test_full_prompt_hit_recomputes_last_token():
    bm = BlockManager(8, 4)
    toks = list(range(8))
    blocks = admit(bm, "a", toks)
    bm.free("a")
    assert bm.get_computed_blocks(toks) == (blocks[:1], 4)  # both blocks cached, one used
    assert bm.get_computed_blocks(toks + [99]) == (blocks, 8)
    assert bm.get_computed_blocks(toks[:4]) == ([], 0)
    assert bm.get_computed_blocks([]) == ([], 0)
    # Lookups are read-only and counted in tokens.
    assert all(bm.blocks[b].ref_count == 0 for b in blocks) and bm.num_free_blocks == 8
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (8 + 8 + 9 + 4, 0 + 4 + 8 + 0)


def test_freed_cached_blocks_are_revived():
    bm = BlockManager(8, 4)
    toks = list(range(10))
    first = admit(bm, "a", toks)
    assert len(first) == 3
    bm.free("a")
    assert bm.num_free_blocks == 8
    hits, n = bm.get_computed_blocks(toks)
    assert (hits, n) == (first[:2], 8) and all(b in bm.free_queue for b in hits)
    got = bm.allocate_slots("b", toks, n, 2, hits)
    assert got[:2] == hits and len(got) == 3
    assert [bm.blocks[b].ref_count for b in got] == [1, 1, 1]
    assert not set(got) & set(bm.free_queue) and bm.num_free_blocks == 5


def test_shared_prefix_is_ref_counted_and_costs_no_free_blocks():
    bm = BlockManager(4, 2)
    a = admit(bm, "a", [1, 2, 3, 4, 5])
    assert bm.num_free_blocks == 1
    b = admit(bm, "b", [1, 2, 3, 4, 6])  # 2 shared blocks + 1 new: fits in the 1 free block
    assert b[:2] == a[:2] and b[2] != a[2]
    assert [bm.blocks[x].ref_count for x in b] == [2, 2, 1]
    bm.free("a")
    assert [bm.blocks[x].ref_count for x in a] == [1, 1, 0]
    assert list(bm.free_queue) == [a[2]]
    bm.free("b")
    assert bm.num_free_blocks == 4
    bm.free("b")  # unknown id: no-op
    assert bm.num_free_blocks == 4


def test_lru_eviction_drops_the_hash():
    bm = BlockManager(4, 2)
    a = admit(bm, "a", [1, 2, 3, 4])
    b = admit(bm, "b", [5, 6, 7, 8])
    a_hashes = [bm.blocks[x].hash for x in a]
    assert all(h in bm.cached for h in a_hashes)
    bm.free("a")
    bm.free("b")
    c = admit(bm, "c", [9, 9, 9, 9])  # takes the least recently freed blocks, tail first
    assert c == a[::-1]
    assert not any(h in bm.cached for h in a_hashes)
    assert bm.get_computed_blocks([1, 2, 3, 4, 0]) == ([], 0)
    assert bm.get_computed_blocks([5, 6, 7, 8, 0]) == (b, 4)


def test_tail_and_unhashed_blocks_are_reused_before_the_prefix():
    bm = BlockManager(3, 2)
    a = admit(bm, "a", [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] cached, [5] partial
    bm.free("a")
    assert admit(bm, "x", [7]) == [a[2]]  # the unhashed block goes first
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == (a[:2], 4)
    assert admit(bm, "y", [8]) == [a[1]]  # then the tail of the cached prefix
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == (a[:1], 2)


def test_unhashed_blocks_freed_later_are_still_reused_first():
    bm = BlockManager(4, 2)
    a = admit(bm, "a", [1, 2, 3, 4])  # two cached blocks
    x = admit(bm, "x", [7])  # one partial, never-cached block
    bm.free("a")
    bm.free("x")
    got = admit(bm, "y", [9, 9, 9])
    assert got[0] == x[0] and a[0] not in got and a[1] not in got
    assert bm.get_computed_blocks([1, 2, 3, 4, 0]) == (a, 4)


def test_refused_allocation_changes_nothing():
    bm = BlockManager(4, 2)
    admit(bm, "a", [1, 2, 3, 4, 5])
    before = snapshot(bm)
    assert bm.allocate_slots("b", [7, 7, 7, 7], 0, 4) is None
    assert snapshot(bm) == before and bm.block_ids("b") == []
    # Decode growth that does not fit either.
    assert bm.allocate_slots("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 5, 4) is None
    assert snapshot(bm) == before
    # Reviving cached blocks needs free blocks too: 2 revived + 3 new > 4.
    bm.free("a")
    hits, n = bm.get_computed_blocks(list(range(1, 10)))
    assert (hits, n) == (bm.get_computed_blocks([1, 2, 3, 4, 5])[0], 4)
    before = snapshot(bm)
    assert bm.allocate_slots("c", list(range(1, 10)), n, 5, hits) is None
    assert snapshot(bm) == before


def test_full_blocks_are_hashed_only_once_full():
    bm = BlockManager(8, 4)
    toks = [1, 2, 3, 4, 5]
    t = admit(bm, "a", toks)
    assert bm.blocks[t[0]].hash is not None and bm.blocks[t[1]].hash is None
    for tok in (6, 7, 8):
        toks.append(tok)
        assert bm.allocate_slots("a", toks, len(toks) - 1, 1) == []
        assert (bm.blocks[t[1]].hash is not None) == (len(toks) == 8)
    assert bm.blocks[t[1]].token_ids == (5, 6, 7, 8)
    assert bm.allocate_slots("a", toks + [9], 8, 1) != []  # a new block for token 9


def test_concurrent_duplicates_keep_one_copy_and_chain_on():
    bm = BlockManager(12, 4)
    toks = list(range(9))
    a = bm.allocate_slots("a", toks, 0, 9)
    b = bm.allocate_slots("b", toks, 0, 9)  # same step: neither saw the other's blocks
    assert set(a).isdisjoint(b)
    assert [bm.blocks[x].hash is not None for x in b] == [False, False, False]
    b_toks = toks + [9, 10, 11, 100]
    bm.allocate_slots("b", b_toks, 9, 4)
    assert bm.blocks[b[2]].token_ids == (8, 9, 10, 11)  # chained onto a's copies
    bm.free("a")
    bm.free("b")
    assert bm.get_computed_blocks(b_toks) == ([a[0], a[1], b[2]], 12)


def test_forced_hash_collision_never_returns_a_wrong_block(monkeypatch):
    monkeypatch.setattr(prefix_hash, "hash_block_tokens", lambda parent, tokens: 7)
    bm = BlockManager(8, 2)
    a = admit(bm, "a", [1, 2, 3, 4, 5])
    assert list(bm.cached.values()) == [a[0]]  # block 2 collided with block 1: not cached
    assert bm.get_computed_blocks([9, 9, 3, 4, 5]) == ([], 0)
    assert bm.get_computed_blocks([1, 2, 3, 4, 5]) == (a[:1], 2)


def test_parent_collision_never_returns_a_wrong_block(monkeypatch):
    # A hash that ignores the parent: equal blocks under different prefixes collide.
    monkeypatch.setattr(prefix_hash, "hash_block_tokens", lambda parent, tokens: hash(tuple(tokens)))
    bm = BlockManager(8, 2)
    a = admit(bm, "a", [1, 1, 5, 5, 0])
    c = admit(bm, "c", [2, 2, 6, 6, 0])
    # [2,2] hits c's block; [5,5] matches a's block by hash and tokens, but a's block holds
    # the KV of [1,1,5,5], not [2,2,5,5].
    assert bm.get_computed_blocks([2, 2, 5, 5, 0]) == (c[:1], 2)
    assert bm.get_computed_blocks([1, 1, 5, 5, 0]) == (a[:2], 4)


def test_stale_hit_is_rejected():
    bm = BlockManager(2, 2)
    admit(bm, "a", [1, 2, 3])
    bm.free("a")
    hits, n = bm.get_computed_blocks([1, 2, 3])
    admit(bm, "x", [7, 7, 7])  # reuses both blocks, evicting the hit
    bm.free("x")
    with pytest.raises(EngineInternalError, match="new_computed_blocks"):
        bm.allocate_slots("b", [1, 2, 3], n, 1, hits)


def test_prefix_caching_disabled():
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    toks = list(range(10))
    admit(bm, "a", toks)
    assert all(b.hash is None for b in bm.blocks) and bm.cached == {}
    bm.free("a")
    assert bm.get_computed_blocks(toks) == ([], 0)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache():
    bm = BlockManager(8, 4)
    toks = list(range(9))
    admit(bm, "a", toks)
    assert bm.reset_prefix_cache() is False and bm.cached
    bm.free("a")
    assert bm.reset_prefix_cache() is True
    assert bm.cached == {} and bm.get_computed_blocks(toks) == ([], 0)


def test_counts_usage_and_errors():
    bm = BlockManager(10, 4)
    admit(bm, "a", [1, 2, 3, 4, 5])
    assert bm.usage == pytest.approx(0.2) and bm.num_free_blocks == 8
    assert bm.block_ids("nobody") == []
    hits, n = bm.get_computed_blocks([1, 2, 3, 4, 5])
    with pytest.raises(EngineInternalError, match="already holds blocks"):
        bm.allocate_slots("a", [1, 2, 3, 4, 5], n, 1, hits)
    with pytest.raises(EngineInternalError, match="num_computed_tokens=0"):
        bm.allocate_slots("b", [1, 2, 3, 4, 5], 0, 5, hits)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)


def test_hash_is_chained():
    h1 = hash_block_tokens(None, [1, 2])
    assert h1 == hash_block_tokens(None, [1, 2])
    assert h1 != hash_block_tokens(None, [2, 1])
    assert hash_block_tokens(h1, [3, 4]) != hash_block_tokens(hash_block_tokens(None, [0, 0]), [3, 4])
