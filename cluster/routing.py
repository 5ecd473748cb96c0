"""Prefix-aware choice among engine replicas: what a replica reports, and the router's policy
(actors/ plugs both into Ray Serve).

Every replica reports a `PrefixCacheSummary` (`PrefixCacheReporter` builds it): the routing keys of the blocks its prefix cache
holds now (evictions included) plus those of prompts it has queued. A prompt's keys come from
the same chained block hashes (`prompt_routing_keys`), so the longest run of a prompt's keys a
replica holds, from the first block on, is the prefix that replica would not recompute.

A summary arrives a stats period after the fact, so the policy also remembers where it sent
each prompt (`routed`): those keys count for that replica until a summary that must already
reflect them replaces them (`settle_s` after routing) or `pending_ttl_s` passes. Requests that
share a new prefix therefore follow the first one at once, and a replica that evicted a
prefix stops attracting it a few seconds later. Ray Serve LLM's PrefixCacheAffinityRouter, by
contrast, guesses from a text tree of past requests and never learns of an eviction.

A replica with the KV tier on (cluster/kv_tier.py) also reports the keys its node's store
holds. Past the blocks a replica holds in its pool, the prompt's next blocks in its store count
too, each `tier_hit_weight` of a pool block: reading a block back is far cheaper than computing
it, dearer than finding it in the pool. Copies sharing one store gain equally from it, so among
them the pool still decides; a copy on another node, without those files, loses to them.

The choice, given each candidate's load (requests in flight) and its match (pool blocks plus
weighted tier blocks):
  - no replica with `min_match_blocks` of the prompt in its pool and tier: the least-loaded
    replica (NO_PREFIX);
  - else the least loaded of the replicas with the best match (PREFIX_HIT, or TIER_HIT when
    less than `min_match_blocks` of it is in the pool), unless it has more than
    `imbalance_threshold` requests above the least-loaded replica, which then gets the request
    (LOAD_FALLBACK) and, from then on, that prefix too.

A LoRA adapter's prompt blocks are keyed under the adapter (its cache salt), and a replica
reports a key for each adapter loaded in its slots; a request for an adapter leads its keys
with that key, `min_match_blocks` times. So a replica with the adapter loaded counts as a
prefix hit of `min_match_blocks` blocks, plus the blocks it holds of that prompt under that
adapter: requests go where their adapter is loaded, with the same load fallback.
"""
from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from cluster.lora.adapter import LoRARequest, lora_cache_salt
from cluster.messages import PrefixCacheSummary
from cluster.prefix_hash import adapter_routing_key, prompt_routing_keys

PREFIX_HIT, TIER_HIT, LOAD_FALLBACK, NO_PREFIX = "prefix_hit", "tier_hit", "load_fallback", "no_prefix"


class CacheContents(Protocol):
    """What the reporter reads of a block manager (cluster/engine/block_manager.py)."""

    block_size: int
    cache_version: int
    cached: dict[int, int]

    def cached_keys(self, in_use: bool) -> list[int]: ...


class QueuedPrompt(Protocol):
    """What the reporter reads of a waiting request (cluster/engine/request.py)."""

    request_id: str
    prompt_token_ids: list[int]
    num_computed_tokens: int
    cache_salt: int | None  # its LoRA adapter's


class PrefixCacheReporter:
    """The replica side: one engine's prefix cache as a `PrefixCacheSummary`.

    The keys are the cached blocks in use, then the blocks of prompts still queued (computed
    soon, so a router should count them), then the free cached blocks, most recently freed
    first (evicted last): a `limit` drops what the engine would evict first. Cheap when
    nothing changed: the last summary is returned as is while the cache's version and the
    count of admitted requests stand still, and a queued prompt is hashed once."""

    def __init__(self, cache: CacheContents) -> None:
        self.cache = cache
        self._summary: PrefixCacheSummary | None = None
        self._limit: int | None = None
        self._queued_keys: dict[str, list[int]] = {}  # by request id

    def summary(self, waiting: Iterable[QueuedPrompt], num_admitted: int,
                limit: int | None = None, adapter_salts: Sequence[int] = (),
                num_adapter_loads: int = 0, tier: tuple[int, list[int]] = (0, [])) -> PrefixCacheSummary:
        """`waiting`: the engine's waiting requests; `num_admitted`: requests admitted since
        start; `adapter_salts`: the cache salts of the LoRA adapters loaded in its slots, and
        `num_adapter_loads` the loads so far; `tier`: the KV tier's (version, keys)
        (`TierStore.routing_keys`). The summary's version moves with these counts and versions,
        each of which only grows."""
        cache = self.cache
        version = cache.cache_version + num_admitted + num_adapter_loads + tier[0]
        if self._summary is not None and (self._summary.version, self._limit) == (version, limit):
            return self._summary
        queued = [r for r in waiting if r.num_computed_tokens == 0]
        self._queued_keys = {r.request_id: self._queued_keys.get(r.request_id)
                             or prompt_routing_keys(r.prompt_token_ids, cache.block_size, r.cache_salt)
                             for r in queued}
        in_use, free = cache.cached_keys(in_use=True), cache.cached_keys(in_use=False)
        adapters = [adapter_routing_key(salt) for salt in adapter_salts]
        keys = list(dict.fromkeys(itertools.chain(adapters, in_use, *self._queued_keys.values(), free)))
        self._summary = PrefixCacheSummary(cache.block_size, version, keys[:limit], len(cache.cached), tier[1][:limit])
        self._limit = limit
        return self._summary


@dataclass(frozen=True)
class RoutingDecision:
    replica: Hashable
    reason: str  # PREFIX_HIT | TIER_HIT | LOAD_FALLBACK | NO_PREFIX
    matched_blocks: int  # the chosen replica's cached prefix of the prompt, in blocks
    tier_blocks: int = 0  # the blocks after those its node's KV tier holds


@dataclass
class _Replica:
    held: frozenset[int] = frozenset()  # keys of the last summary
    tier: frozenset[int] = frozenset()  # its KV tier's keys in the last summary
    version: int | None = None
    pending: dict[int, float] = field(default_factory=dict)  # key -> when a prompt was routed here


@dataclass
class PrefixAffinityPolicy:
    """Where each replica's prefix cache stands, and the choice of a replica for a prompt.

    Not thread-safe; one instance per router. Replicas are any hashable ids."""

    block_size: int
    imbalance_threshold: int = 16  # requests in flight above the least-loaded replica
    min_match_blocks: int = 2  # a shorter cached prefix (a shared chat header) is no reason to go there
    tier_hit_weight: float = 0.9  # a block in a replica's KV tier, against one in its pool
    settle_s: float = 2.0  # a summary received this long after routing reflects that request
    pending_ttl_s: float = 30.0
    max_pending: int = 1 << 16  # keys remembered per replica between summaries
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    replicas: dict[Hashable, _Replica] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("block_size", "min_match_blocks", "max_pending"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("imbalance_threshold", "settle_s", "pending_ttl_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be non-negative, got {getattr(self, name)}")
        if not 0 <= self.tier_hit_weight <= 1:
            raise ValueError(f"tier_hit_weight must be between 0 and 1, got {self.tier_hit_weight}")

    # ---- what the replicas hold -----------------------------------------------------------
    def report(self, replica: Hashable, summary: PrefixCacheSummary) -> None:
        """A replica's summary arrived (a repeated version is ignored)."""
        if summary.block_size != self.block_size:
            raise ValueError(f"replica {replica} reports block_size {summary.block_size}, "
                             f"the router hashes prompts with {self.block_size}")
        state = self.replicas.setdefault(replica, _Replica())
        if summary.version == state.version:
            return
        state.held, state.tier, state.version = frozenset(summary.keys), frozenset(summary.tier_keys), summary.version
        settled = self.clock() - self.settle_s
        state.pending = {k: t for k, t in state.pending.items() if t > settled}

    def forget(self, replica: Hashable) -> None:
        self.replicas.pop(replica, None)

    def routed(self, replica: Hashable, keys: Sequence[int]) -> None:
        """A prompt with these keys went to `replica`: it will hold them soon."""
        pending = self.replicas.setdefault(replica, _Replica()).pending
        now = self.clock()
        for k in keys:
            pending.pop(k, None)  # re-insert: dict order stays oldest first
            pending[k] = now
        while len(pending) > self.max_pending:
            del pending[next(iter(pending))]

    def keys(self, token_ids: Sequence[int], lora: LoRARequest | None = None) -> list[int]:
        """A prompt's routing keys; under an adapter (with its folder, as the ingress sends it),
        its adapter key `min_match_blocks` times, then its blocks' keys under that adapter."""
        if lora is None or lora.lora_path is None:
            return prompt_routing_keys(token_ids, self.block_size)
        salt = lora_cache_salt(lora.lora_name, lora.lora_path)
        lead = [adapter_routing_key(salt)] * self.min_match_blocks
        return lead + prompt_routing_keys(token_ids, self.block_size, salt)

    def matched_blocks(self, replica: Hashable, keys: Sequence[int]) -> int:
        """The prompt's leading blocks the replica holds in its pool (or was sent lately)."""
        return self.matched(replica, keys)[0]

    def matched(self, replica: Hashable, keys: Sequence[int]) -> tuple[int, int]:
        """(pool, tier): the prompt's leading blocks the replica holds in its pool (or was sent
        lately), then how many of the blocks that follow its KV tier holds."""
        state = self.replicas.get(replica)
        if state is None:
            return 0, 0
        expired = self.clock() - self.pending_ttl_s
        n = 0
        for k in keys:
            if k not in state.held and state.pending.get(k, expired) <= expired:
                break
            n += 1
        t = 0
        for k in keys[n:]:
            if k not in state.tier:
                break
            t += 1
        return n, t

    # ---- the choice ---------------------------------------------------------------------------
    def choose(self, keys: Sequence[int], loads: Mapping[Hashable, int]) -> RoutingDecision:
        """The replica for a prompt with these keys among `loads` (candidate -> requests in flight)."""
        if not loads:
            raise ValueError("choose() needs at least one candidate replica")
        matched = {r: self.matched(r, keys) for r in loads}
        score = {r: pool + self.tier_hit_weight * tier for r, (pool, tier) in matched.items()}
        least = self._least_loaded(list(loads), loads, score)
        if max(pool + tier for pool, tier in matched.values()) < self.min_match_blocks:
            return RoutingDecision(least, NO_PREFIX, *matched[least])
        best = max(score.values())
        holder = self._least_loaded([r for r in loads if score[r] == best], loads, score)
        if loads[holder] - loads[least] > self.imbalance_threshold:
            return RoutingDecision(least, LOAD_FALLBACK, *matched[least])
        pool, tier = matched[holder]
        return RoutingDecision(holder, PREFIX_HIT if pool >= self.min_match_blocks else TIER_HIT, pool, tier)

    def _least_loaded(self, candidates: list, loads: Mapping, score: Mapping) -> Hashable:
        """Fewest requests in flight, then the best match, then at random."""
        low = min((loads[r], -score[r]) for r in candidates)
        return self.rng.choice([r for r in candidates if (loads[r], -score[r]) == low])
