"""CUDA graphs for pure-decode steps.

At start-up the runner captures the model's forward pass for a ladder of batch sizes up to
max_num_seqs (`capture_sizes`); a step whose every sequence decodes one token replays the
smallest captured size that holds it, its inputs padded. Prefill and mixed steps run eagerly.

A replay reads only static buffers, which each step overwrites in place: input ids,
positions, slot mapping, context lengths and block tables. They are filled in pinned host
memory and sent with non-blocking copies. Padded rows are harmless: they write their K/V
into a scratch block the engine never hands out and attend that one token. All graphs share
one memory pool and write their hidden states into one output buffer, which the runner reads
before the next replay.

The CUDA calls sit behind `GraphSeam` (`CudaGraphSeam` on a GPU): on CPU the tests drive the
same bookkeeping with a seam that records captures and replays and runs the model eagerly.
Graphs need an attention backend that reads the block table from the metadata
(`GRAPH_BACKENDS`); the torch backend's per-step gather buckets cannot be captured.
TP works unchanged: the NCCL all-reduces are captured in every rank's graphs, which all
ranks capture in the same order; the LM head's gather to rank 0 runs after the replay.
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Protocol

import torch
from torch import nn

from cluster.model.context import AttentionMetadata, FlashMetadata, set_forward_context

GRAPH_BACKENDS = ("triton", "flash_attn")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, every multiple of 16 below max_num_seqs, and
    max_num_seqs itself, so padding never costs more than 15 rows past 16."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4, 8) if s < max_num_seqs} | set(range(16, max_num_seqs, 16))
    return sorted(sizes | {max_num_seqs})


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_seqs; None when it exceeds them all."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class GraphSeam(Protocol):
    """The CUDA graph calls: a memory pool, capture of a callable, replay."""

    def new_pool(self) -> Any: ...

    def capture(self, fn: Callable[[], None], pool: Any) -> Any:
        """Run `fn` once eagerly (warm-up), then capture it into a graph using `pool`."""

    def replay(self, graph: Any) -> None: ...


class CudaGraphSeam:
    def new_pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], None], pool: Any) -> torch.cuda.CUDAGraph:
        fn()  # outside the capture: lazy initialisation, Triton compilation, cuBLAS workspaces
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            fn()
        torch.cuda.synchronize()
        return graph

    def replay(self, graph: torch.cuda.CUDAGraph) -> None:
        graph.replay()


class DecodeGraphs:
    """Static buffers, the captured graphs per batch size, and the per-step staging.

    `scratch_block` must be a KV block outside the engine's block ids (the runner allocates
    one more block than it reports)."""

    def __init__(self, max_num_seqs: int, max_model_len: int, block_size: int, scratch_block: int,
                 hidden_size: int, dtype: torch.dtype, device: torch.device, seam: GraphSeam) -> None:
        self.sizes = capture_sizes(max_num_seqs)
        self.block_size, self.scratch_block, self.seam = block_size, scratch_block, seam
        self.max_blocks = -(-max_model_len // block_size)
        max_bs = self.sizes[-1]
        pin = device.type == "cuda"
        # Host staging (pinned on CUDA) and their device twins: rows 0..2 of `longs` are the
        # input ids, positions and slot mapping.
        self.host_longs = torch.zeros(3, max_bs, dtype=torch.long, pin_memory=pin)
        self.host_lens = torch.zeros(max_bs, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self.longs = torch.zeros(3, max_bs, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slot_mapping = self.longs[0], self.longs[1], self.longs[2]
        self.context_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(max_bs, self.max_blocks, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(max_bs, hidden_size, dtype=dtype, device=device)
        self._no_prefill = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, Any] = {}
        self.num_replays = 0  # pure-decode steps served by a graph (stats, the GPU check)
        # The staging is refilled only after the previous step's copies have left it.
        self._copied = torch.cuda.Event() if pin else None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def metadata(self, size: int) -> AttentionMetadata:
        """What the attention layers read during the capture of `size`: views of the static
        buffers, so a replay sees whatever the last `stage` wrote there."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], num_tokens=size, num_decodes=size,
            block_size=self.block_size,
            flash=FlashMetadata(decode_seqlens=self.context_lens[:size], decode_block_table=self.block_tables[:size],
                                cu_seqlens_q=self._no_prefill, cu_seqlens_k=self._no_prefill, max_seqlen_q=0,
                                max_seqlen_k=0, prefill_block_table=self.block_tables[:1]))

    def capture(self, model: nn.Module) -> None:
        """Capture every size, largest first (later captures reuse the pool's memory). Call
        inside torch.inference_mode(), with the model's KV cache bound."""
        max_bs = self.sizes[-1]
        self.stage([], [], [], max_bs)  # every row a padding row: valid, harmless inputs
        pool = self.seam.new_pool()
        for size in reversed(self.sizes):
            meta = self.metadata(size)

            def forward(size: int = size, meta: AttentionMetadata = meta) -> None:
                with set_forward_context(meta):
                    self.hidden[:size] = model(self.input_ids[:size], self.positions[:size])

            self.graphs[size] = self.seam.capture(forward, pool)

    def stage(self, input_ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]],
              size: int) -> None:
        """Write one decode step (n sequences, seqs as for build_attention_metadata) into the
        static buffers, rows n..size-1 as padding."""
        n, bs = len(input_ids), self.block_size
        if self._copied is not None:
            self._copied.synchronize()
        longs, lens, tables = self.host_longs.numpy(), self.host_lens.numpy(), self.host_tables.numpy()
        longs[0, :n], longs[1, :n] = input_ids, positions
        for i, (_, context_len, block_ids) in enumerate(seqs):
            used = -(-context_len // bs)
            tables[i, :used] = block_ids[:used]
            pos = context_len - 1
            longs[2, i] = block_ids[pos // bs] * bs + pos % bs
            lens[i] = context_len
        longs[0:2, n:size] = 0
        longs[2, n:size] = self.scratch_block * bs
        lens[n:size] = 1
        tables[n:size, 0] = self.scratch_block
        self.longs.copy_(self.host_longs, non_blocking=True)
        self.context_lens.copy_(self.host_lens, non_blocking=True)
        self.block_tables[:size].copy_(self.host_tables[:size], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def run(self, input_ids: list[int], positions: list[int], seqs: list[tuple[int, int, list[int]]]
            ) -> torch.Tensor:
        """Replay the graph for a pure-decode step; hidden states [n, hidden] (a view of the
        shared output buffer: valid until the next replay)."""
        n = len(input_ids)
        size = padded_size(n, self.sizes)
        if size is None or n != len(seqs):
            raise ValueError(f"a graph step takes 1..{self.sizes[-1]} single-token sequences, got {n} tokens "
                             f"for {len(seqs)} sequences")
        self.stage(input_ids, positions, seqs, size)
        self.seam.replay(self.graphs[size])
        self.num_replays += 1
        return self.hidden[:n]
