"""Vocab-parallel embedding and LM head. The vocab is split into equal (padded) ranges,
one per rank; the head gathers its logit shards to rank 0 and drops the padding."""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.gguf_file import GGUFBlocks
from cluster.model.layers.cpu_gemm import PackedWeight
from cluster.model.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    # Where the rows come from instead of `weight`: a tied head's quantized blocks (read_tied_blocks).
    rows_of: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel = parallel or SINGLE
        self.vocab_size = vocab_size
        # Ceil so any vocab splits; the last rank's tail rows are zero padding.
        self.per_rank = -(-vocab_size // parallel.world_size)
        self.start = parallel.rank * self.per_rank
        self.end = max(self.start, min(self.start + self.per_rank, vocab_size))
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding: expected shape ({self.vocab_size}, {param.shape[1]}), "
                             f"got {tuple(loaded.shape)}")
        rows = self.end - self.start
        param.data[:rows].copy_(loaded[self.start:self.end])
        param.data[rows:].zero_()

    def read_rows_from(self, rows_of: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Look rows up through `rows_of(local ids) -> [..., hidden]` and drop the float table."""
        self.rows_of = rows_of
        self.weight = None

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.rows_of is None else self.rows_of(ids)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self._rows(input_ids)
        inside = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(inside, input_ids - self.start, 0)
        out = self._rows(local)
        return self.parallel.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Full-vocab logits on rank 0 (None elsewhere). With tied embeddings the model points
    `weight` at the embedding's parameter, whose shard ranges are the same."""

    packed: PackedWeight | None = None  # the weight in the CPU GEMMs' layouts (cpu_gemm), once packed
    is_lm_head = True  # quantization plans treat it apart from the layers
    gguf_segments: list[tuple[int, GGUFBlocks]] | None = None  # [(0, this rank's rows of a GGUF head)], until packed

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext | None = None,
                 bias: bool = False) -> None:
        super().__init__(vocab_size, hidden_size, parallel)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.per_rank), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:
            rows = self.end - self.start
            param.data[:rows].copy_(loaded[self.start:self.end])
            param.data[rows:].zero_()
            return
        super().weight_loader(param, loaded, shard_id)

    def load_blocks(self, blocks: GGUFBlocks, shard_id=None) -> None:
        """This rank's vocab rows of a GGUF head served in its own blocks (gguf_file.GGUFBlocks),
        zero blocks for the padding rows, kept until packing (a tied head's too: the embedding
        gets the same tensor in floats)."""
        hidden = self.weight.shape[1]
        if blocks.shape != (self.vocab_size, hidden):
            raise ValueError(f"LM head: expected a GGUF tensor of shape ({self.vocab_size}, {hidden}), got {blocks.shape}")
        raw = torch.zeros(self.per_rank, blocks.raw.shape[1], dtype=torch.uint8)
        raw[: self.end - self.start] = blocks.raw[self.start:self.end]
        self.gguf_segments = [(0, blocks.with_rows(raw))]

    def pack_weight(self, packed: PackedWeight, release: bool) -> None:
        """Switch to the packed weight; a tied head keeps the embedding's (release False)."""
        self.packed = packed
        if release:
            self.weight = None

    def packed_rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of this rank's packed weight, dequantized into `dtype` (its current
        blocks: packing may move them, e.g. to huge pages)."""
        return self.packed.rows(ids, dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:
        if self.packed is None:
            logits = F.linear(hidden, self.weight, self.bias)
        else:
            logits = self.packed.linear(hidden, self.bias)
        logits = self.parallel.gather_to_rank0(logits, dim=-1)
        if logits is None or logits.shape[-1] == self.vocab_size:
            return logits
        return logits[..., : self.vocab_size]


def read_tied_blocks(model: nn.Module, dtype: torch.dtype) -> int:
    """An embedding whose table is a head's weight (tied) that is now served in quantized blocks
    that can give rows (`reads_rows`) looks its rows up in those blocks, dequantized into
    `dtype` as it reads them, and the float table goes: a tied Q6_K table of Llama-3.2-1B is
    1 GB in fp32 and 0.2 GB in its blocks. Returns how many embeddings switched."""
    heads = {id(m.weight): m for m in model.modules()
             if isinstance(m, ParallelLMHead) and m.weight is not None and getattr(m.packed, "reads_rows", False)}
    switched = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding):
            continue
        head = heads.get(id(module.weight)) if module.weight is not None else None
        if head is not None:
            module.read_rows_from(functools.partial(head.packed_rows, dtype=dtype))
            head.weight = None
            switched += 1
    return switched
