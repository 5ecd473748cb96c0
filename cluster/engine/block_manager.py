"""Paged-KV block manager with automatic prefix caching.

Each request owns a block table (physical block ids, one per `block_size` tokens). A block
that becomes full is registered in the prefix cache under a chained hash (parent hash + its
token ids), so a later request with the same prefix reuses it instead of recomputing it.
Freed blocks stay in the cache while they sit in the free queue: they are revived on a hit
and evicted (their hash dropped) only when allocation reuses them, least recently freed first.

With the KV tier (cluster/kv_tier.py) on, each block registered is also noted in `new_cached` (the
scheduler has it written to the tier).

`cached_keys()` summarizes what the cache holds for a prefix-aware router (cluster/routing.py),
which names a prompt's blocks with `prompt_routing_keys`: the same chained hashes
(cluster/prefix_hash.py), cut to 64 bits.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from cluster.errors import EngineInternalError
from cluster import prefix_hash

_ROOT_KEY = 0  # the parent key of a request's first block (base model; an adapter's: _root_key)


def _root_key(salt: int | None) -> int:
    """The first block's parent key under a LoRA adapter's cache salt: negative, so it never
    equals a registration serial, and different for every salt."""
    return _ROOT_KEY if salt is None else -1 - salt


@dataclass(slots=True)
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None  # set only while the block is registered in the prefix cache
    token_ids: tuple[int, ...] = ()  # the block's own tokens, compared on every hit
    # Registration serial, and the serial of the block holding the previous block's worth of
    # tokens. A hit needs both the stored tokens and this link to match, so neither a hash
    # collision nor a reused parent can ever hand out a block computed under another prefix.
    key: int | None = None
    parent_key: int | None = None


@dataclass(slots=True)
class _RequestBlocks:
    table: list[int] = field(default_factory=list)
    num_hashed: int = 0  # leading blocks of `table` already looked at for the cache
    last_hash: int | None = None  # chain hash of block num_hashed - 1
    last_key: int | None = _ROOT_KEY  # key of the cached copy of that block (None: chain broken)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Blocks with ref count 0, popped from the front: never-cached ones sit at the front,
        # cached (revivable) ones are appended at the back in the order they were freed.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.requests: dict[str, _RequestBlocks] = {}
        self._keys = itertools.count(_ROOT_KEY + 1)
        self.cache_version = 0  # advances whenever a block is cached or evicted
        # (block id, chain hash, tokens) of each block registered since the last pop_new_cached();
        # None: not recorded (no KV tier).
        self.new_cached: list[tuple[int, int, tuple[int, ...]]] | None = None
        self.reset_stats()

    def reset_stats(self) -> None:
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    def block_ids(self, req_id: str) -> list[int]:
        st = self.requests.get(req_id)
        return list(st.table) if st else []

    # ---- prefix cache -----------------------------------------------------------------
    def _lookup(self, h: int, tokens: tuple[int, ...], parent_key: int | None) -> Block | None:
        bid = self.cached.get(h)
        if bid is None:
            return None
        block = self.blocks[bid]
        return block if block.token_ids == tokens and block.parent_key == parent_key else None

    def get_computed_blocks(self, token_ids: Sequence[int], salt: int | None = None) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks computed under the same `salt` (a LoRA adapter's
        cache salt, None for the base model): (block ids, tokens). Read-only but for the stats."""
        if not self.enable_prefix_caching:
            return [], 0
        bs, hits, key = self.block_size, [], _root_key(salt)
        for h, tokens in prefix_hash.cacheable_blocks(token_ids, bs, salt):
            block = self._lookup(h, tokens, key)
            if block is None:
                break
            hits.append(block.id)
            key = block.key
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += len(hits) * bs
        return hits, len(hits) * bs

    def _cache_full_blocks(self, st: _RequestBlocks, token_ids: Sequence[int], num_tokens: int) -> None:
        bs = self.block_size
        num_full = min(num_tokens, len(token_ids)) // bs
        while st.num_hashed < num_full and st.last_key is not None:
            i = st.num_hashed
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            h = prefix_hash.hash_block_tokens(st.last_hash, tokens)
            twin = self._lookup(h, tokens, st.last_key)
            if twin is not None:  # computed concurrently by another request: keep that copy
                key = twin.key
            elif h in self.cached:  # taken by a block we can't verify (a collision): stop here
                key = None
            else:
                block = self.blocks[st.table[i]]
                block.hash, block.token_ids, block.parent_key = h, tokens, st.last_key
                block.key = key = next(self._keys)
                self.cached[h] = block.id
                self.cache_version += 1
                if self.new_cached is not None:
                    self.new_cached.append((block.id, h, tokens))
            st.num_hashed, st.last_hash, st.last_key = i + 1, h, key

    def _evict(self, block: Block) -> None:
        if self.cached.get(block.hash) == block.id:
            del self.cached[block.hash]
            self.cache_version += 1
        block.hash, block.token_ids, block.key, block.parent_key = None, (), None, None

    def cached_keys(self, in_use: bool) -> list[int]:
        """Routing keys of the cached blocks in use (`in_use`), or of the free cached blocks,
        most recently freed (so evicted last) first."""
        if in_use:
            hashes = [h for h, bid in self.cached.items() if self.blocks[bid].ref_count > 0]
        else:
            hashes = [h for h in (self.blocks[bid].hash for bid in reversed(self.free_queue)) if h is not None]
        return [h & prefix_hash.ROUTING_KEY_MASK for h in hashes]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for bid in list(self.cached.values()):
            self._evict(self.blocks[bid])
        return True

    # ---- allocation -------------------------------------------------------------------
    def allocate_slots(self, req_id: str, token_ids: Sequence[int], num_computed_tokens: int,
                       num_new_tokens: int, new_computed_blocks: Sequence[int] = (),
                       salt: int | None = None) -> list[int] | None:
        """Grow req_id's table to cover num_computed_tokens + num_new_tokens (the first time
        starting with the cache hits `new_computed_blocks`) and cache the blocks that are full,
        under `salt` (as in get_computed_blocks; read when the table is created).
        Returns the blocks appended, or None, with nothing changed, when too few are free."""
        st = self.requests.get(req_id)
        if new_computed_blocks:
            if st is not None and st.table:
                raise EngineInternalError(f"new_computed_blocks given for request {req_id!r}, "
                                 "which already holds blocks")
            if len(new_computed_blocks) * self.block_size > num_computed_tokens:
                raise EngineInternalError(f"new_computed_blocks hold {len(new_computed_blocks) * self.block_size} "
                                 f"tokens, more than num_computed_tokens={num_computed_tokens}")
            self._check_hit(new_computed_blocks, token_ids, salt)
        have = len(st.table) if st else 0
        total = num_computed_tokens + num_new_tokens
        num_new = max(0, -(-total // self.block_size) - have - len(new_computed_blocks))
        num_revived = sum(self.blocks[b].ref_count == 0 for b in new_computed_blocks)
        if num_new + num_revived > len(self.free_queue):
            return None  # checked before any change, so a refusal leaves no trace
        if st is None:
            st = self.requests[req_id] = _RequestBlocks(last_hash=salt, last_key=_root_key(salt))
        self._take(new_computed_blocks)
        if new_computed_blocks:
            last = self.blocks[new_computed_blocks[-1]]
            st.num_hashed, st.last_hash, st.last_key = len(new_computed_blocks), last.hash, last.key
        fresh = [self._pop_free() for _ in range(num_new)]
        st.table += [*new_computed_blocks, *fresh]
        if self.enable_prefix_caching:
            self._cache_full_blocks(st, token_ids, total)
        return [*new_computed_blocks, *fresh]

    def pop_new_cached(self) -> list[tuple[int, int, tuple[int, ...]]]:
        """The blocks registered since the last call: (block id, chain hash, tokens)."""
        out = self.new_cached
        if out is None:
            return []
        self.new_cached = []
        return out

    def _take(self, block_ids: Sequence[int]) -> None:
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self.free_queue[bid]
            block.ref_count += 1

    def _check_hit(self, block_ids: Sequence[int], token_ids: Sequence[int], salt: int | None) -> None:
        # A hit is only good until the next allocation may evict it: refuse a stale one.
        bs, key = self.block_size, _root_key(salt)
        for i, bid in enumerate(block_ids):
            block = self.blocks[bid]
            if block.hash is None or block.parent_key != key or \
                    block.token_ids != tuple(token_ids[i * bs:(i + 1) * bs]):
                raise EngineInternalError(f"new_computed_blocks: block {bid} no longer caches tokens "
                                 f"{i * bs}..{(i + 1) * bs - 1} of this request")
            key = block.key

    def _pop_free(self) -> int:
        bid, _ = self.free_queue.popitem(last=False)
        block = self.blocks[bid]
        if block.hash is not None:  # reused for new tokens: its cached contents are gone
            self._evict(block)
        block.ref_count = 1
        return bid

    def free_tail(self, req_id: str, num_tokens: int) -> int:
        """Shrink req_id's table to the blocks holding its first num_tokens tokens (the slots
        of rejected draft tokens go back). Returns how many blocks were released. Released
        blocks were never registered in the prefix cache: registration needs a block full
        of known tokens, and a block past num_tokens holds at least one draft slot."""
        st = self.requests.get(req_id)
        if st is None:
            return 0
        keep = -(-num_tokens // self.block_size)
        if keep < st.num_hashed:
            raise EngineInternalError(f"free_tail({req_id!r}, {num_tokens}) would drop blocks "
                                      f"registered in the prefix cache ({st.num_hashed} are)")
        tail = st.table[keep:]
        del st.table[keep:]
        for bid in reversed(tail):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                self.free_queue.move_to_end(bid, last=False)
        return len(tail)

    def free(self, req_id: str, num_computed_tokens: int | None = None) -> None:
        """Release req_id's blocks (finished, aborted or preempted). Unknown ids are ignored.
        With `num_computed_tokens` (a sequence preempted in the step that planned more of it), the
        blocks past those tokens were registered for a chunk no step will compute: they leave the
        prefix cache. (A sequence started in that same step that hit one is not helped: the
        scheduler never preempts one it started, but may one it scheduled before.)"""
        st = self.requests.pop(req_id, None)
        if st is None:
            return
        if num_computed_tokens is not None:
            for bid in st.table[num_computed_tokens // self.block_size: st.num_hashed]:
                self._evict(self.blocks[bid])
        # Tail first, so a prefix's later blocks are evicted before the blocks they extend.
        for bid in reversed(st.table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[bid] = None
                if block.hash is None:  # nothing worth keeping: reuse it before cached blocks
                    self.free_queue.move_to_end(bid, last=False)
