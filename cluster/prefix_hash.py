"""The chained block hashes that name a prompt's blocks: what the block manager caches by and
what a prefix-aware router matches with (cluster/routing.py), computed the same way on both sides.

A full block's hash covers its parent's hash and its own token ids, so equal hashes mean equal
prefixes (the block manager still compares tokens on every hit). A routing key is a hash cut to
its low 64 bits: 8 bytes in a replica's report.
"""
from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence

import xxhash

ROUTING_KEY_MASK = (1 << 64) - 1  # routing keys: the low 64 bits of a chain hash (8 bytes each)


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained 128-bit hash of a full block: its parent's hash, then its token ids."""
    h = xxhash.xxh3_128()
    h.update((parent_hash or 0).to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def cacheable_blocks(token_ids: Sequence[int], block_size: int,
                     salt: int | None = None) -> Iterator[tuple[int, tuple[int, ...]]]:
    """(chain hash, tokens) of each full block of a prompt the prefix cache may serve, in order:
    (n - 1) // block_size blocks at most, since the last token is always recomputed for its logits.
    `salt` (a LoRA adapter's `cache_salt`) starts the chain: blocks computed under different
    adapters, or none, never share a hash."""
    h = salt
    for i in range((len(token_ids) - 1) // block_size):
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        h = hash_block_tokens(h, tokens)
        yield h, tokens


def prompt_routing_keys(token_ids: Sequence[int], block_size: int, salt: int | None = None) -> list[int]:
    """The routing keys of a prompt's cacheable blocks, first block first: what a router matches
    against the keys an engine reports (`BlockManager.cached_keys`)."""
    return [h & ROUTING_KEY_MASK for h, _ in cacheable_blocks(token_ids, block_size, salt)]


def adapter_routing_key(cache_salt: int) -> int:
    """The routing key that stands for a LoRA adapter being loaded on a copy (its cache salt
    hashed once more, so it is no block's key)."""
    return xxhash.xxh3_64_intdigest(cache_salt.to_bytes(8, "little") + b"lora") & ROUTING_KEY_MASK
