"""The scheduler's side of the KV tier (cluster/kv_tier.py): which prompt blocks a starting
request reads from the node's store instead of computing, and which blocks a step completes
that the store lacks.

A request that starts with blocks in the store past its pool hits has them read in the very
step that starts it: the scheduler gives it fresh blocks for them, books their tokens as
computed and puts a `KVLoad` in the plan; every rank reads its files and copies them in before
that step's forward, then computes the rest of the prompt in the same forward. So a tier hit
costs its request no extra step. A read that fails on some rank (a file evicted or damaged
since `contains` saw it) is computed instead, in the same step, before the forward: nothing the
scheduler booked changes, and the result only counts it (`StepResult.kv_load_failed`).

Blocks found only on the disk level are first copied up to shared memory by a thread of this
process (`ready`): the request waits for that, as one waiting for its grammar does, and the
others go on, so a slow disk never holds up a step; the step then reads at memory speed.

Writing pays only while blocks are read back. A store smaller than the conversations cycling
through it evicts each one's blocks before its next turn, so LRU reads nothing back while every
write still costs its copy and file. So after each turnover (this copy has computed as many new
blocks as the store holds), the planner decides the next one: it holds (writes nothing, so the
store's contents stay and stay readable) when fewer than 1 in PAYING_SHARE of the turnover's
blocks was read back while writing, and goes on holding while what it kept is read back at least
that much; otherwise it writes.

Guarantees: the blocks a load names are the request's own from the step that plans it (so no
later step can reuse them before the read is in); the saves name only blocks registered for
tokens the step computes, never loaded ones (the store has those).
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from cluster import prefix_hash
from cluster.kv_tier import TierStore
from cluster.messages import KVBlock, KVLoad, StepResult

Found = tuple[int, tuple[int, ...], int]  # a block in the tier: chain hash, tokens, slowest level
# A turnover pays when at least one block in this many is read back: a write (copy out, checksum,
# file) costs a fraction of computing the block that a read saves.
PAYING_SHARE = 8


class TierPlanner:
    def __init__(self, store: TierStore, block_size: int) -> None:
        self.store, self.block_size = store, block_size
        self._load_ids = itertools.count()
        self.reads: dict[int, int] = {}  # load id -> its tokens, until a result reports it
        self.promoting: dict[str, Future] = {}  # request id -> its blocks' copy from disk to shared memory
        self._promoter = ThreadPoolExecutor(1, thread_name_prefix="kv-tier-promote")
        self.capacity: int | None = None  # blocks the store holds, once a rank reported a file's size
        self.holding = False  # this turnover writes nothing (module docstring)
        self.turnover_new = 0  # blocks computed (written or held) in this turnover
        self.turnover_read = 0  # blocks read back in this turnover
        self.reset_stats()

    def reset_stats(self) -> None:
        self.hit_tokens = 0  # prompt tokens read from the KV tier instead of computed
        self.load_failures = 0  # loads some rank could not read (computed instead)
        self.promotions = 0  # blocks copied up from disk to shared memory before their read
        self.writes_held = 0  # blocks not written because the tier was holding

    def found(self, token_ids: Sequence[int], num_hits: int, salt: int | None) -> list[Found]:
        """(chain hash, tokens, level) of the cacheable blocks that follow a prompt's `num_hits`
        pool hits and that every rank's files hold (level: the slowest holding one), up to the
        first one missing."""
        out = []
        for i, (h, tokens) in enumerate(prefix_hash.cacheable_blocks(token_ids, self.block_size, salt)):
            if i < num_hits:
                continue
            level = self.store.level_of(h)
            if level is None:
                break
            out.append((h, tokens, level))
        return out

    def ready(self, req_id: str, found: Sequence[Found]) -> bool:
        """Whether a step may read `found` for `req_id` now: every block in the first level, or
        the request's copy of them up there done (wherever a budget moved them since). Otherwise
        that copy is started, or still under way."""
        copy = self.promoting.get(req_id)
        if copy is not None:
            if not copy.done():
                return False
            del self.promoting[req_id]
            self.promotions += copy.result()
            return True
        below = [h for h, _, level in found if level]
        if below:
            self.promoting[req_id] = self._promoter.submit(lambda: sum(map(self.store.promote, below)))
        return not below

    def forget(self, req_id: str) -> None:
        """A request finished: its copy, if any, is no longer waited for."""
        self.promoting.pop(req_id, None)

    def load(self, req_id: str, first_block: int, block_ids: Sequence[int],
             found: Sequence[Found]) -> KVLoad:
        """The read of `found` into `block_ids` (the request's blocks from index `first_block`)."""
        load_id = next(self._load_ids)
        self.reads[load_id] = len(found) * self.block_size
        blocks = [KVBlock(bid, h.to_bytes(16, "little"), list(tokens)) for bid, (h, tokens, _) in zip(block_ids, found)]
        return KVLoad(load_id, blocks, req_id, first_block * self.block_size)

    def saves(self, registered: Sequence[tuple[int, int, tuple[int, ...]]]) -> list[KVBlock]:
        """Of the blocks just registered in the pool (block id, chain hash, tokens), those the
        store lacks: written by the workers after the step that computes them, unless the tier
        is holding."""
        new = [KVBlock(bid, h.to_bytes(16, "little"), list(tokens))
               for bid, h, tokens in registered if not self.store.contains(h)]
        holding = self.holding
        self._count_new(len(new))
        if holding:
            self.writes_held += len(new)
            return []
        return new

    def _count_new(self, n: int) -> None:
        """Count `n` new blocks; at the end of a turnover decide whether the next one holds."""
        self.turnover_new += n
        if self.capacity is None or self.turnover_new < self.capacity:
            return
        paying = self.turnover_read * PAYING_SHARE >= self.turnover_new
        # Writing that is not read back stops; holding goes on while what it kept is read.
        self.holding = paying if self.holding else not paying
        self.turnover_new = self.turnover_read = 0

    def reported(self, result: StepResult) -> None:
        if self.capacity is None and result.kv_tier is not None and result.kv_tier.blocks_written:
            file_bytes = result.kv_tier.bytes_written // result.kv_tier.blocks_written  # rank 0's
            self.capacity = max(1, self.store.budget // (file_bytes * self.store.world_size))
        for load_id in result.kv_loaded:
            tokens = self.reads.pop(load_id, 0)
            self.hit_tokens += tokens
            self.turnover_read += tokens // self.block_size
        for load_id in result.kv_load_failed:
            self.reads.pop(load_id, None)
            self.load_failures += 1
