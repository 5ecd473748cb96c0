"""Tensor-parallel linear layers. Each parameter carries `weight_loader(param, full, shard_id)`
that takes the FULL checkpoint tensor and copies this rank's slice into the parameter. A GGUF
tensor served in its own blocks comes to `load_blocks` instead: the layer keeps this rank's rows
(or, row-parallel, whole blocks of its inputs) as they are, packed after loading
(quantization.quantize_module)."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from cluster.model.gguf_file import GGUFBlocks
from cluster.model.layers.cpu_gemm import PackedWeight
from cluster.model.layers.lora import LoRAStack
from cluster.model.layers.weights import copy_checked
from cluster.model.parallel import SINGLE, ParallelContext, divide, local_kv_heads

logger = logging.getLogger(__name__)


def _check_rows(loaded: torch.Tensor, rows: int, what: str) -> None:
    if loaded.shape[0] != rows:
        raise ValueError(f"{what}: the checkpoint tensor has {loaded.shape[0]} rows, expected {rows} "
                         f"(shape {tuple(loaded.shape)})")


class LinearBase(nn.Module):
    packed: PackedWeight | None = None  # the weight in the CPU GEMMs' layouts (cpu_gemm), once packed
    lora: LoRAStack | None = None  # the adapters' A and B slots, with enable_lora (layers/lora.py)
    # (first local row, its blocks) per GGUF tensor loaded in its blocks, until packed
    gguf_segments: list[tuple[int, GGUFBlocks]] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        raise NotImplementedError

    def load_blocks(self, blocks: GGUFBlocks, shard_id=None) -> None:
        """This rank's part of a GGUF tensor served in its own blocks (gguf_file.GGUFBlocks, the
        full tensor `weight_loader` would get dequantized), kept as it is until packing. A part
        that would cut blocks (a row-parallel shard) is loaded dequantized instead, with a warning."""
        expected = self.checkpoint_in_features
        if blocks.in_features != expected:
            raise ValueError(f"GGUF tensor of {blocks.in_features} inputs for a linear layer of {expected} "
                             f"(shard {shard_id!r})")
        first, part = self.local_blocks(blocks, shard_id)
        if part is None:
            logger.warning("a %s tensor of %d inputs: this rank's %d are not whole %d-input blocks (a TP shard); "
                           "served dequantized", blocks.gguf_type, blocks.in_features, self.in_features, blocks.block_inputs)
            self.weight_loader(self.weight, blocks.dequantize(), shard_id)
            return
        self.gguf_segments = [*(self.gguf_segments or []), (first, part)]

    @property
    def checkpoint_in_features(self) -> int:
        """The inputs of the checkpoint's (full) tensor."""
        return self.in_features

    def local_blocks(self, blocks: GGUFBlocks, shard_id=None) -> tuple[int, GGUFBlocks | None]:
        """(first local row, this rank's GGUFBlocks or None) of a full tensor's blocks: the rows
        `local_rows` takes of the weight (column-parallel layers)."""
        first, rows = self.local_rows(blocks.rows, shard_id)
        return first, blocks.select_rows(rows)

    def pack_weight(self, packed: PackedWeight, release: bool) -> None:
        """Switch to the packed weight; `release` drops the plain one."""
        self.packed = packed
        if release:
            self.weight = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = F.linear(x, self.weight, bias) if self.packed is None else self.packed.linear(x, bias)
        if self.lora is not None:  # before a row-parallel all-reduce: the deltas are partial sums too
            self.lora.apply(out, x)
        return out

    def local_rows(self, loaded: torch.Tensor, shard_id=None) -> tuple[int, torch.Tensor]:
        """(first local row, this rank's rows) of a full tensor laid out like the checkpoint's
        weight (or shard `shard_id` of it) along dim 0: the weight's and a LoRA B's rows."""
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; the output stays sharded (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        parallel = parallel or SINGLE
        self.out_local = divide(out_features, parallel.world_size, "out_features")
        super().__init__(in_features, self.out_local, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        copy_checked(param.data, self.local_rows(loaded)[1], "column-parallel linear")

    def local_rows(self, loaded: torch.Tensor, shard_id=None) -> tuple[int, torch.Tensor]:
        _check_rows(loaded, self.out_local * self.parallel.world_size, "column-parallel linear")
        return 0, loaded.narrow(0, self.parallel.rank * self.out_local, self.out_local)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_proj + up_proj); `shard_id` is
    the index of the checkpoint tensor being loaded."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        self.output_sizes = output_sizes
        super().__init__(in_features, sum(output_sizes), bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, part = self.local_rows(loaded, shard_id)
        copy_checked(param.data.narrow(0, offset, part.shape[0]), part, f"merged shard {shard_id}")

    def local_rows(self, loaded: torch.Tensor, shard_id=None) -> tuple[int, torch.Tensor]:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        ws = self.parallel.world_size
        _check_rows(loaded, self.output_sizes[shard_id], f"merged shard {shard_id}")
        size = divide(self.output_sizes[shard_id], ws, "output size")
        return sum(self.output_sizes[:shard_id]) // ws, loaded.narrow(0, self.parallel.rank * size, size)


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by heads. This rank's q heads are a
    contiguous range; its KV heads are `local_kv_heads` (replicated where needed)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, parallel: ParallelContext | None = None) -> None:
        parallel = parallel or SINGLE
        self.head_dim = head_dim
        self.kv_heads = local_kv_heads(num_heads, num_kv_heads, parallel)
        self.total_heads, self.total_kv_heads = num_heads, num_kv_heads
        self.num_heads = num_heads // parallel.world_size
        self.num_kv_heads = len(self.kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        # Bypass the column split: the local width is computed from heads above.
        LinearBase.__init__(self, hidden_size, out, bias, parallel)
        self.out_local = out

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        offset, part = self.local_rows(loaded, shard_id)
        copy_checked(param.data.narrow(0, offset, part.shape[0]), part, f"qkv shard {shard_id}")

    def local_rows(self, loaded: torch.Tensor, shard_id=None) -> tuple[int, torch.Tensor]:
        hd = self.head_dim
        if shard_id in ("q", "k", "v"):
            heads = self.total_heads if shard_id == "q" else self.total_kv_heads
            _check_rows(loaded, heads * hd, f"qkv shard {shard_id}")
        if shard_id == "q":
            offset, part = 0, loaded.narrow(0, self.parallel.rank * self.q_size, self.q_size)
        elif shard_id in ("k", "v"):
            heads = loaded.unflatten(0, (-1, hd))[torch.tensor(self.kv_heads)]
            offset = self.q_size + (self.kv_size if shard_id == "v" else 0)
            part = heads.flatten(0, 1)
        else:
            raise ValueError(f"shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return offset, part


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial outputs are summed by an all-reduce.
    The bias is added once, after the reduction."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        parallel = parallel or SINGLE
        self.in_local = divide(in_features, parallel.world_size, "in_features")
        super().__init__(self.in_local, out_features, bias, parallel)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param is self.bias:
            copy_checked(param.data, loaded, "row-parallel bias")
            return
        copy_checked(param.data, self.local_cols(loaded), "row-parallel linear")

    def local_cols(self, loaded: torch.Tensor) -> torch.Tensor:
        """This rank's input columns of a full [rows, in_features] tensor (the weight, a LoRA A)."""
        return loaded.narrow(1, self.parallel.rank * self.in_local, self.in_local)

    @property
    def checkpoint_in_features(self) -> int:
        return self.in_local * self.parallel.world_size

    def local_blocks(self, blocks: GGUFBlocks, shard_id=None) -> tuple[int, GGUFBlocks | None]:
        """Every row, this rank's inputs: None unless they are whole blocks."""
        return 0, blocks.inputs(self.parallel.rank * self.in_local, self.in_local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.matmul(x, self.bias)
        out = self.parallel.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias
