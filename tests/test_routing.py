"""Prefix-aware routing without Ray: the routing keys agree with the block manager, engines
summarize what they hold (evictions included), and the policy's choices."""
import random

import pytest

from cluster.engine.block_manager import BlockManager
from cluster.prefix_hash import cacheable_blocks, prompt_routing_keys
from cluster.messages import PrefixCacheSummary
from cluster.routing import LOAD_FALLBACK, NO_PREFIX, PREFIX_HIT, TIER_HIT, PrefixAffinityPolicy, RoutingDecision

BS = 4


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _alloc(bm: BlockManager, rid: str, tokens: list[int]) -> int:
    """Admit a prompt as the scheduler does: cache hits first, then fresh blocks. Returns the hit."""
    hits, n = bm.get_computed_blocks(tokens)
    assert bm.allocate_slots(rid, tokens, n, len(tokens) - n, hits) is not None
    return n


def _summary(bm: BlockManager, version: int) -> PrefixCacheSummary:
    keys = bm.cached_keys(in_use=True) + bm.cached_keys(in_use=False)
    return PrefixCacheSummary(bm.block_size, version, keys, len(bm.cached))


# ---- keys and summaries -----------------------------------------------------------------------
def test_routing_keys_are_the_block_managers_chain_hashes():
    bm = BlockManager(16, BS)
    prompt = list(range(1, 15))  # 14 tokens: 3 cacheable blocks (the last token is recomputed)
    keys = prompt_routing_keys(prompt, BS)
    assert len(keys) == 3 == len(list(cacheable_blocks(prompt, BS)))
    assert prompt_routing_keys(prompt[:13], BS) == keys  # 13 tokens: still 3 full blocks
    assert prompt_routing_keys(prompt[:12], BS) == keys[:2]  # block 3 would hold the last token
    assert all(0 <= k < 2 ** 64 for k in keys)
    _alloc(bm, "a", prompt)
    assert set(keys) <= set(bm.cached_keys(in_use=True)) and bm.cached_keys(in_use=False) == []
    # A different first block changes every later key (chained), even for equal later tokens.
    other = prompt_routing_keys([99] + prompt[1:], BS)
    assert not set(other) & set(keys)


def test_cached_keys_follow_eviction_order_and_drop_evicted_blocks():
    bm = BlockManager(8, BS)
    a, b = list(range(100, 113)), list(range(200, 213))  # 3 blocks + 1 token each: 4 blocks
    _alloc(bm, "a", a)
    _alloc(bm, "b", b)
    bm.free("a")
    bm.free("b")
    version = bm.cache_version
    # Both prefixes stay cached while free; b was freed last, so it is evicted last: listed first
    # (a prompt's first block is freed after its later ones, so it comes first).
    free = bm.cached_keys(in_use=False)
    assert free[:3] == prompt_routing_keys(b, BS) and set(free[3:]) == set(prompt_routing_keys(a, BS))
    # A new prompt needs 4 fresh blocks: the uncached tail blocks go first, then a's blocks.
    _alloc(bm, "c", list(range(300, 313)))
    assert bm.cache_version > version
    held = set(bm.cached_keys(in_use=True) + bm.cached_keys(in_use=False))
    assert set(prompt_routing_keys(b, BS)) <= held
    assert len(set(prompt_routing_keys(a, BS)) & held) < 3  # a was (partly) evicted: no longer reported


def test_engine_summary_holds_cached_and_queued_prompts(tiny_llama_dir):
    from cluster import LLM, SamplingParams
    from cluster.messages import EngineRequest

    llm = LLM(tiny_llama_dir, dtype="float32", max_model_len=256, num_kv_blocks=64, block_size=16)
    core, params = llm.engine, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    first = core.prefix_cache_summary()
    assert (first.keys, first.block_size, first.num_cached_blocks) == ([], 16, 0)
    assert core.prefix_cache_summary() is first  # nothing changed: the same summary
    done = [(7 * i) % 5000 + 10 for i in range(70)]
    llm.generate([{"prompt_token_ids": done}], params, use_tqdm=False)
    after = core.prefix_cache_summary()
    assert after.version != first.version and set(prompt_routing_keys(done, 16)) <= set(after.keys)
    queued = [(11 * i) % 5000 + 10 for i in range(50)]
    core.add_request(EngineRequest("q", queued, params))  # admitted, not scheduled yet
    summary = core.prefix_cache_summary()
    assert set(prompt_routing_keys(queued, 16)) <= set(summary.keys)
    assert set(prompt_routing_keys(done, 16)) <= set(summary.keys)
    assert len(core.prefix_cache_summary(limit=2).keys) == 2
    while core.has_unfinished():
        core.step()


# ---- the policy ---------------------------------------------------------------------------------
def _policy(**kw) -> tuple[PrefixAffinityPolicy, Clock]:
    clock = Clock()
    return PrefixAffinityPolicy(BS, clock=clock, rng=random.Random(0), **kw), clock


def test_longest_cached_prefix_wins_then_the_least_loaded_holder():
    policy, _ = _policy()
    keys = [1, 2, 3, 4, 5]
    policy.report("a", PrefixCacheSummary(BS, 1, [1, 2], 2))
    policy.report("b", PrefixCacheSummary(BS, 1, [1, 2, 3, 4], 4))
    policy.report("c", PrefixCacheSummary(BS, 1, [2, 3, 4, 5], 4))  # no first block: no prefix at all
    assert [policy.matched_blocks(r, keys) for r in "abc"] == [2, 4, 0]
    assert policy.choose(keys, {"a": 0, "b": 3, "c": 0}) == _decision("b", PREFIX_HIT, 4)
    policy.report("a", PrefixCacheSummary(BS, 2, [1, 2, 3, 4], 4))
    assert policy.choose(keys, {"a": 2, "b": 3, "c": 0}).replica == "a"  # equal match: less loaded


def test_load_fallback_beyond_the_threshold_and_no_prefix_goes_to_the_least_loaded():
    policy, _ = _policy(imbalance_threshold=4)
    policy.report("a", PrefixCacheSummary(BS, 1, [1, 2, 3], 3))
    assert policy.choose([1, 2, 3], {"a": 4, "b": 0}) == _decision("a", PREFIX_HIT, 3)
    assert policy.choose([1, 2, 3], {"a": 5, "b": 0}) == _decision("b", LOAD_FALLBACK, 0)
    assert policy.choose([7, 8], {"a": 0, "b": 1}) == _decision("a", NO_PREFIX, 0)
    assert policy.choose([], {"a": 3, "b": 1}) == _decision("b", NO_PREFIX, 0)
    # A one-block match (say, a chat template's header) is below min_match_blocks=2: by load.
    assert policy.choose([1, 9, 9], {"a": 1, "b": 0}) == _decision("b", NO_PREFIX, 0)


def test_blocks_in_a_copys_kv_tier_count_after_its_pool_at_their_weight():
    """Copies a and b share one node's KV tier, which holds the whole prompt; c, on another node,
    holds three blocks in its pool and no tier."""
    policy, _ = _policy(imbalance_threshold=4)
    keys, tier = [1, 2, 3, 4, 5, 6], [6, 5, 4, 3, 2, 1, 99]
    policy.report("a", PrefixCacheSummary(BS, 1, [1, 2], 2, tier))
    policy.report("b", PrefixCacheSummary(BS, 1, [], 0, tier))
    policy.report("c", PrefixCacheSummary(BS, 1, [1, 2, 3], 3))
    assert [policy.matched(r, keys) for r in "abc"] == [(2, 4), (0, 6), (3, 0)]
    # a: 2 + 0.9 * 4; b: 0.9 * 6; c: 3. The pool decides between the copies sharing the tier.
    assert policy.choose(keys, {"a": 1, "b": 0, "c": 0}) == RoutingDecision("a", PREFIX_HIT, 2, 4)
    policy.report("a", PrefixCacheSummary(BS, 2, [], 0, tier))  # a's pool evicted the prefix
    assert policy.choose(keys, {"a": 1, "b": 0, "c": 0}) == RoutingDecision("b", TIER_HIT, 0, 6)
    assert policy.choose(keys, {"a": 0, "b": 1, "c": 0}) == RoutingDecision("a", TIER_HIT, 0, 6)
    # The load fallback still applies, and the tier counts only from the first block on.
    assert policy.choose(keys, {"a": 6, "b": 5, "c": 0}) == RoutingDecision("c", LOAD_FALLBACK, 3, 0)
    assert policy.matched("b", [9, 1, 2]) == (0, 0)
    policy.report("b", PrefixCacheSummary(BS, 2, [], 0, [1, 2, 4]))  # block 3 evicted from the tier
    assert policy.matched("b", keys) == (0, 2)
    # Weighed at 0, the tier is ignored: c's three pool blocks win.
    plain, _ = _policy(tier_hit_weight=0)
    for r, held in (("b", []), ("c", [1, 2, 3])):
        plain.report(r, PrefixCacheSummary(BS, 1, held, len(held), tier))
    assert plain.choose(keys, {"b": 0, "c": 0}) == RoutingDecision("c", PREFIX_HIT, 3, 3)


def test_routed_prompts_count_until_a_later_summary_or_the_ttl():
    policy, clock = _policy(settle_s=2.0, pending_ttl_s=30.0)
    policy.report("a", PrefixCacheSummary(BS, 1, [], 0))
    policy.routed("a", [1, 2, 3])
    assert policy.choose([1, 2, 3, 4], {"a": 3, "b": 0}) == _decision("a", PREFIX_HIT, 3)
    clock.now += 1.0
    policy.report("a", PrefixCacheSummary(BS, 2, [], 0))  # too soon to reflect the request: kept
    assert policy.matched_blocks("a", [1, 2, 3]) == 3
    clock.now += 1.5
    policy.report("a", PrefixCacheSummary(BS, 2, [], 0))  # same version: ignored
    assert policy.matched_blocks("a", [1, 2, 3]) == 3
    policy.report("a", PrefixCacheSummary(BS, 3, [1], 1))  # later: the engine holds only block 1
    assert policy.matched_blocks("a", [1, 2, 3]) == 1
    policy.routed("b", [5, 6])
    clock.now += 31
    assert policy.matched_blocks("b", [5, 6]) == 0  # never confirmed: expired
    policy.forget("a")
    assert policy.matched_blocks("a", [1]) == 0


def test_bad_settings_and_mismatched_block_sizes_are_rejected():
    with pytest.raises(ValueError, match="block_size"):
        PrefixAffinityPolicy(0)
    with pytest.raises(ValueError, match="tier_hit_weight must be between 0 and 1, got 1.5"):
        PrefixAffinityPolicy(BS, tier_hit_weight=1.5)
    with pytest.raises(ValueError, match="imbalance_threshold"):
        PrefixAffinityPolicy(BS, imbalance_threshold=-1)
    policy, _ = _policy()
    with pytest.raises(ValueError, match="block_size 16"):
        policy.report("a", PrefixCacheSummary(16, 1, [], 0))
    with pytest.raises(ValueError, match="candidate"):
        policy.choose([1], {})


def _decision(replica, reason, matched):
    from cluster.routing import RoutingDecision

    return RoutingDecision(replica, reason, matched)


# ---- two block managers behind the policy ------------------------------------------------------
def _fleet_hit_rate(route, prompts, num_blocks) -> float:
    fleet = {"a": BlockManager(num_blocks, BS), "b": BlockManager(num_blocks, BS)}
    hits = total = 0
    for i, prompt in enumerate(prompts):
        name = route(prompt, fleet)
        hits += _alloc(fleet[name], f"r{i}", prompt)
        total += len(prompt)
        fleet[name].free(f"r{i}")
    return hits / total


def test_policy_on_real_block_managers_nearly_matches_one_engine_and_beats_random():
    rng = random.Random(7)
    prefixes = [[rng.randrange(1000) for _ in range(10 * BS)] for _ in range(8)]
    prompts = [rng.choice(prefixes) + [rng.randrange(1000) for _ in range(2 * BS)] for _ in range(120)]
    policy, clock = _policy()
    version = iter(range(1, 10**6))

    def affinity(prompt, fleet):
        keys = policy.keys(prompt)
        choice = policy.choose(keys, {name: 0 for name in fleet}).replica
        policy.routed(choice, keys)
        clock.now += 0.1
        for name, bm in fleet.items():  # summaries a stats period late: every 10th request
            if int(clock.now * 10) % 10 == 0:
                policy.report(name, _summary(bm, next(version)))
        return choice

    single = _fleet_hit_rate(lambda p, fleet: "a", prompts, num_blocks=512)
    prefix_aware = _fleet_hit_rate(affinity, prompts, num_blocks=512)
    randomly = _fleet_hit_rate(lambda p, fleet: rng.choice("ab"), prompts, num_blocks=512)
    assert single - prefix_aware < 0.02 and prefix_aware > randomly + 0.03, (single, prefix_aware, randomly)


def test_adapter_requests_go_where_the_adapter_is_loaded_and_key_blocks_by_adapter():
    """A LoRA request's keys: its adapter's key min_match_blocks times, then its blocks salted by
    the adapter, which is what an engine caches them under. A copy with the adapter loaded is a
    hit of min_match_blocks (more with the prompt cached under it); load still wins past the threshold."""
    from cluster.lora import LoRARequest
    from cluster.lora.adapter import lora_cache_salt
    from cluster.prefix_hash import adapter_routing_key

    policy, _ = _policy(imbalance_threshold=4)
    prompt = list(range(1, 15))
    sql = LoRARequest("sql", lora_path="/adapters/sql")
    salt = lora_cache_salt("sql", "/adapters/sql")
    keys = policy.keys(prompt, sql)
    assert keys[:2] == [adapter_routing_key(salt)] * 2
    assert keys[2:] == prompt_routing_keys(prompt, BS, salt)
    assert not set(keys[2:]) & set(policy.keys(prompt))  # the base model's blocks are other keys
    bm = BlockManager(16, BS)  # an engine that ran the prompt under sql
    hits, n = bm.get_computed_blocks(prompt, salt)
    bm.allocate_slots("a", prompt, n, len(prompt) - n, hits, salt=salt)
    assert set(keys[2:]) <= set(bm.cached_keys(in_use=True))
    policy.report("loaded", PrefixCacheSummary(BS, 1, [adapter_routing_key(salt)], 0))
    policy.report("cached", PrefixCacheSummary(BS, 1, [adapter_routing_key(salt)] + bm.cached_keys(True), 3))
    policy.report("base", PrefixCacheSummary(BS, 1, policy.keys(prompt), 3))  # the prompt, but for the base
    assert [policy.matched_blocks(r, keys) for r in ("loaded", "cached", "base")] == [2, 5, 0]
    assert policy.choose(keys, {"loaded": 0, "cached": 2, "base": 0}) == _decision("cached", PREFIX_HIT, 5)
    assert policy.choose(keys, {"loaded": 0, "base": 0}) == _decision("loaded", PREFIX_HIT, 2)
    assert policy.choose(keys, {"loaded": 5, "base": 0}).reason == LOAD_FALLBACK
