"""Per-step attention metadata and the forward context that carries it to every layer.

The runner builds one `AttentionMetadata` per step with `build_attention_metadata` and
runs the model inside `set_forward_context(meta)`; each `Attention` layer reads it with
`get_forward_context()`. Everything derived from the batch layout (slot mapping, gather
indices, masks, flash-attn's cu_seqlens, the CPU kernel's block tables) is computed here once,
for the model's attention backend, and shared by all layers.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Iterator

import torch

# Decode rows are sorted by context length and split into buckets, each padded to its
# longest row. A bucket costs its padded tokens plus a fixed overhead (a dozen small ops per
# layer), expressed here in padded tokens; _bucket_bounds minimises the total.
_BUCKET_OVERHEAD_TOKENS = 1024
_MAX_BUCKET_GROUPS = 48  # bounds the O(groups^2) search
# The CPU kernel (backend "cpu_paged") takes the decodes and the prefill chunks of at most this
# many queries, all sequences in one call; longer chunks go one at a time to the kernel
# library's prefill_attention (bf16 on AVX512-BF16) or SDPA. Measured on the 2-core EPYC, 2
# threads, bf16, SmolLM2's heads, 4 layers (2026-11-25): the paged kernel is faster than
# prefill_attention up to 48 queries over any prefix (4 chunks of 48 over 256 cached tokens: 4.5
# vs 7.1 ms), level at 64 over 1024 (22.2 vs 22.6 ms) and behind from 96 over long prefixes or
# 128 alone; against SDPA it was ahead at 64 over 256 (1.8 vs 2.3 ms).
KERNEL_PREFILL_MAX_QUERY = 64


@dataclass
class DecodeBucket:
    """Decode rows of similar context length, attended together in one batched call."""

    rows: torch.Tensor | None  # indices among the decode rows; None = all of them, in order
    token_index: torch.Tensor  # [n * L] cache slots of every (row, key position), padded
    mask: torch.Tensor  # [n, 1, L] fp32 additive mask: 0 for real keys, -inf for padding
    num_seqs: int
    max_len: int  # L: the longest context in the bucket


@dataclass
class PrefillChunk:
    """One sequence's chunk of this step's tokens (query_len > 1)."""

    start: int  # token range [start, start + query_len) in the flat batch
    query_len: int
    context_len: int
    context_index: torch.Tensor | None  # [context_len] cache slots, None without a cached prefix
    mask: torch.Tensor | None  # [query_len, context_len] bool (True = attend), with a cached prefix


@dataclass
class FlashMetadata:
    """What flash-attn's paged entry points need (CUDA only)."""

    decode_seqlens: torch.Tensor  # [D] int32 context lengths
    decode_block_table: torch.Tensor  # [D, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [P + 1] int32 over prefill chunks
    cu_seqlens_k: torch.Tensor  # [P + 1] int32 over their context lengths
    max_seqlen_q: int
    max_seqlen_k: int
    prefill_block_table: torch.Tensor  # [P, max_blocks] int32


@dataclass
class KernelMetadata:
    """The sequences a paged kernel reads straight from the cache (the CPU kernel): per
    sequence its block table row, context length, first row in the flat batch and query count
    (int32, what the kernel reads)."""

    block_table: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S]
    query_start: torch.Tensor  # [S]
    query_len: torch.Tensor  # [S]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: cache slot each token's K/V is written to
    num_tokens: int
    num_decodes: int  # the first num_decodes tokens are single-token rows
    block_size: int
    decode_buckets: list[DecodeBucket] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    flash: FlashMetadata | None = None
    kernel: KernelMetadata | None = None  # backend "cpu_paged"


def _slots(block_ids: list[int], start: int, end: int, block_size: int) -> torch.Tensor:
    """Cache slots of positions [start, end) of a sequence with this block table."""
    first, last = start // block_size, (end - 1) // block_size + 1
    table = torch.tensor(block_ids[first:last]).unsqueeze(1) * block_size + torch.arange(block_size)
    offset = start - first * block_size
    return table.flatten()[offset: offset + end - start]


def _check(i: int, query_len: int, context_len: int, block_ids: list[int], block_size: int) -> None:
    if query_len < 1 or context_len < query_len:
        raise ValueError(f"seqs[{i}]: need 1 <= query_len <= context_len, got query_len={query_len}, "
                         f"context_len={context_len}")
    if len(block_ids) * block_size < context_len:
        raise ValueError(f"seqs[{i}]: {len(block_ids)} blocks of {block_size} cannot hold "
                         f"context_len={context_len}")


def _bucket_bounds(lengths: list[int]) -> list[tuple[int, int]]:
    """Split lengths sorted in DEcreasing order into [start, end) runs minimising
    sum(run length * longest in run + overhead), by dynamic programming over the runs of
    equal length (coarsened to at most _MAX_BUCKET_GROUPS candidate cut points)."""
    n = len(lengths)
    cuts = [0] + [i for i in range(1, n) if lengths[i] != lengths[i - 1]]
    if len(cuts) > _MAX_BUCKET_GROUPS:
        step = len(cuts) / _MAX_BUCKET_GROUPS
        cuts = [cuts[int(j * step)] for j in range(_MAX_BUCKET_GROUPS)]
    cuts.append(n)
    best, arg = [0] + [0] * (len(cuts) - 1), [0] * len(cuts)
    for e in range(1, len(cuts)):
        best[e], arg[e] = min((best[s] + (cuts[e] - cuts[s]) * lengths[cuts[s]] + _BUCKET_OVERHEAD_TOKENS, s)
                              for s in range(e))
    bounds, e = [], len(cuts) - 1
    while e:
        bounds.append((cuts[arg[e]], cuts[e]))
        e = arg[e]
    return bounds[::-1]


def _decode_buckets(seqs: list[tuple[int, int, list[int]]], num_decodes: int, block_size: int,
                    device: torch.device) -> list[DecodeBucket]:
    order = sorted(range(num_decodes), key=lambda i: -seqs[i][1])
    lengths = [seqs[i][1] for i in order]
    bounds = _bucket_bounds(lengths)
    if len(bounds) == 1:  # one bucket: keep the batch order, no row gather/scatter
        order = list(range(num_decodes))
    buckets = []
    offsets = torch.arange(block_size)
    for start, end in bounds:
        rows = order[start:end]
        max_len = lengths[start]  # the bucket's longest row (lengths are sorted)
        num_blocks = -(-max_len // block_size)
        table = torch.tensor([seqs[i][2][:num_blocks] + [0] * (num_blocks - len(seqs[i][2][:num_blocks]))
                              for i in rows], dtype=torch.long)
        # Gathered per token, so the padding stops at max_len rather than at a block edge.
        token_index = (table.unsqueeze(-1) * block_size + offsets).flatten(1)[:, :max_len].flatten()
        lens = torch.tensor([seqs[i][1] for i in rows])
        mask = torch.zeros(len(rows), 1, max_len).masked_fill_(
            torch.arange(max_len) >= lens.view(-1, 1, 1), float("-inf"))
        buckets.append(DecodeBucket(
            rows=None if len(bounds) == 1 else torch.tensor(rows, device=device),
            token_index=token_index.to(device), mask=mask.to(device),
            num_seqs=len(rows), max_len=max_len))
    return buckets


def _prefill_chunk(start: int, item: tuple[int, int, list[int]], block_size: int,
                   device: torch.device) -> PrefillChunk:
    query_len, context_len, block_ids = item
    if context_len == query_len:  # no cached prefix: attend over this chunk's own K/V
        return PrefillChunk(start, query_len, context_len, None, None)
    index = _slots(block_ids, 0, context_len, block_size).to(device)
    key_pos = torch.arange(context_len, device=device)
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    return PrefillChunk(start, query_len, context_len, index, key_pos <= query_pos.unsqueeze(1))


def _flash_metadata(seqs: list[tuple[int, int, list[int]]], num_decodes: int,
                    device: torch.device) -> FlashMetadata:
    def table(items):
        width = max((len(b) for _, _, b in items), default=1)
        rows = [b + [0] * (width - len(b)) for _, _, b in items] or [[0]]
        return torch.tensor(rows, dtype=torch.int32, device=device)

    def cumulative(xs):
        return torch.tensor([0, *itertools.accumulate(xs)], dtype=torch.int32, device=device)

    decodes, prefills = seqs[:num_decodes], seqs[num_decodes:]
    q_lens = [q for q, _, _ in prefills]
    k_lens = [c for _, c, _ in prefills]
    return FlashMetadata(
        decode_seqlens=torch.tensor([c for _, c, _ in decodes], dtype=torch.int32, device=device),
        decode_block_table=table(decodes), cu_seqlens_q=cumulative(q_lens), cu_seqlens_k=cumulative(k_lens),
        max_seqlen_q=max(q_lens, default=0), max_seqlen_k=max(k_lens, default=0),
        prefill_block_table=table(prefills))


def _kernel_metadata(seqs: list[tuple[int, int, list[int]]], rows: list[int], starts: list[int],
                     block_size: int, device: torch.device) -> KernelMetadata:
    tables = [seqs[i][2][: -(-seqs[i][1] // block_size)] for i in rows]
    width = max(map(len, tables), default=1)
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return KernelMetadata(
        block_table=as_int([t + [0] * (width - len(t)) for t in tables] or [[0]]),
        seq_lens=as_int([seqs[i][1] for i in rows]), query_start=as_int([starts[i] for i in rows]),
        query_len=as_int([seqs[i][0] for i in rows]))


def build_attention_metadata(seqs: list[tuple[int, int, list[int]]], block_size: int,
                             device: torch.device | str, backend: str = "torch") -> AttentionMetadata:
    """seqs: (query_len, context_len, block_ids) per sequence, in the flat token order;
    every query_len == 1 item must come before the others. `backend` (a resolved name, see
    attention.select_backend) decides what is derived: "cpu_paged" gets `kernel` for the
    sequences its kernel takes and `prefills` for the rest; "torch" gets decode buckets (the
    paged GPU backends read the block table themselves)."""
    device = torch.device(device)
    decode_slots: list[int] = []
    prefill_slots: list[torch.Tensor] = []
    for i, (query_len, context_len, block_ids) in enumerate(seqs):
        _check(i, query_len, context_len, block_ids, block_size)
        pos = context_len - 1
        if query_len > 1:
            prefill_slots.append(_slots(block_ids, context_len - query_len, context_len, block_size))
        elif prefill_slots:
            raise ValueError(f"seqs[{i}] is a decode (query_len=1) after a prefill chunk; "
                             "decodes must come first")
        else:
            decode_slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
    num_decodes = len(decode_slots)
    slots = torch.cat([torch.tensor(decode_slots, dtype=torch.long)] + prefill_slots)
    meta = AttentionMetadata(slot_mapping=slots.to(device), num_tokens=len(slots),
                             num_decodes=num_decodes, block_size=block_size)
    starts = list(itertools.accumulate((q for q, _, _ in seqs), initial=0))
    taken: set[int] = set()
    if backend == "cpu_paged":
        rows = [i for i, (q, _, _) in enumerate(seqs) if q <= KERNEL_PREFILL_MAX_QUERY]
        meta.kernel = _kernel_metadata(seqs, rows, starts, block_size, device)
        taken = set(rows)
    elif num_decodes and backend == "torch":
        meta.decode_buckets = _decode_buckets(seqs, num_decodes, block_size, device)
    for i in range(num_decodes, len(seqs)):
        if i not in taken:
            meta.prefills.append(_prefill_chunk(starts[i], seqs[i], block_size, device))
    if device.type == "cuda":
        meta.flash = _flash_metadata(seqs, num_decodes, device)
    return meta


_CONTEXT: AttentionMetadata | None = None


@contextlib.contextmanager
def set_forward_context(meta: AttentionMetadata) -> Iterator[AttentionMetadata]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, meta
    try:
        yield meta
    finally:
        _CONTEXT = previous


def get_forward_context() -> AttentionMetadata:
    if _CONTEXT is None:
        raise RuntimeError("no forward context: run the model inside set_forward_context(meta)")
    return _CONTEXT
