"""Vocab-parallel embedding and LM head. The vocab is split into equal (padded) ranges,
one per rank; the head gathers its logit shards to rank 0 and drops the padding. A GGUF's
k-quant embedding is looked up in its blocks (read_rows_from_blocks): no float table is made."""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.gguf_file import GGUFBlocks
from cluster.model.layers.cpu_gemm import PackedWeight
from cluster.model.layers.quantization import ROW_READ_TYPES, QuantizedWeight
from cluster.model.parallel import SINGLE, ParallelContext


class VocabParallelEmbedding(nn.Module):
    # Where the rows come from instead of `weight`: quantized blocks (read_rows_from_blocks).
    rows_of: Callable[[torch.Tensor], torch.Tensor] | None = None
    gguf_segments: list[tuple[int, GGUFBlocks]] | None = None  # [(0, this rank's rows of a GGUF tensor)], until read
    row_blocks: QuantizedWeight | None = None  # the embedding's own blocks its rows are read from

    def __init__(self, vocab_size: int, hidden_size: int, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.parallel = parallel = parallel or SINGLE
        self.vocab_size = vocab_size
        # Ceil so any vocab splits; the last rank's tail rows are zero padding.
        self.per_rank = -(-vocab_size // parallel.world_size)
        self.start = parallel.rank * self.per_rank
        self.end = max(self.start, min(self.start + self.per_rank, vocab_size))
        # Not zeroed: the loader writes every row (the padding with zeros), and a table served
        # in blocks is dropped without its pages ever being touched.
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"embedding: expected shape ({self.vocab_size}, {param.shape[1]}), "
                             f"got {tuple(loaded.shape)}")
        rows = self.end - self.start
        param.data[:rows].copy_(loaded[self.start:self.end])
        param.data[rows:].zero_()

    def load_blocks(self, blocks: GGUFBlocks, shard_id=None) -> None:
        """A GGUF tensor served in its blocks (gguf_file.GGUFBlocks): this rank's vocab rows are
        kept (a view of the file where no padding row is needed) until read_rows_from_blocks; a
        type whose rows cannot be read alone (ROW_READ_TYPES) is dequantized into `weight`."""
        if not self._keeps_blocks(blocks):
            self.weight_loader(self.weight, blocks.dequantize())
            blocks.release_pages()
            return
        hidden = self.weight.shape[1]
        if blocks.shape != (self.vocab_size, hidden):
            raise ValueError(f"{type(self).__name__}: expected a GGUF tensor of shape ({self.vocab_size}, {hidden}), "
                             f"got {blocks.shape}")
        rows = self.end - self.start
        if rows == self.per_rank:
            raw = blocks.raw[self.start:self.end]
        else:
            raw = torch.zeros(self.per_rank, blocks.raw.shape[1], dtype=torch.uint8)
            raw[:rows] = blocks.raw[self.start:self.end]
        self.gguf_segments = [(0, blocks.with_rows(raw))]

    def _keeps_blocks(self, blocks: GGUFBlocks) -> bool:
        return blocks.gguf_type in ROW_READ_TYPES

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

    def _keeps_blocks(self, blocks: GGUFBlocks) -> bool:
        return True  # the head packs any served type for its GEMM

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


def read_rows_from_blocks(model: nn.Module, kernels: Any, dtype: torch.dtype) -> int:
    """Every embedding that can look its rows up in quantized blocks does so, dequantizing the
    rows a step reads into `dtype`, and keeps no float table: a tied one in its head's packed
    blocks (a tied Q6_K table of Llama-3.2-1B: 1 GB in fp32, 0.2 GB in blocks), an untied one
    given k-quant blocks at load in its own (Llama-3.1-8B's Q4_K table: 2.1 GB in fp32, 0.3 GB).
    Without `kernels` the blocks are dequantized into the table. Runs after the heads are packed;
    returns how many embeddings read rows from blocks."""
    heads = {id(m.weight): m for m in model.modules() if isinstance(m, ParallelLMHead) and m.weight is not None}
    switched = 0
    for module in model.modules():
        if isinstance(module, ParallelLMHead) or not isinstance(module, VocabParallelEmbedding):
            continue
        segments, module.gguf_segments = module.gguf_segments, None
        head = heads.get(id(module.weight)) if module.weight is not None else None
        if head is not None:  # tied: the head's weight is this table (its values, or unwritten behind its blocks)
            if getattr(head.packed, "reads_rows", False):
                module.read_rows_from(functools.partial(head.packed_rows, dtype=dtype))
                head.weight = None
                switched += 1
            continue
        if not segments:
            continue
        ((_, blocks),) = segments
        if kernels is None:
            module.weight_loader(module.weight, blocks.dequantize())
        else:
            module.row_blocks = QuantizedWeight.from_gguf(blocks, kernels)
            module.read_rows_from(functools.partial(module.row_blocks.rows, dtype=dtype))
            switched += 1
        blocks.release_pages()
    return switched
