"""LoRA on the linear layers: each adapted layer holds `max_loras` slots of A and B, and a step
adds every row's adapter delta in one call per layer (the punica scheme, layers/lora_ops.py).

A layer that merges projections (qkv, gate_up) keeps one A stack of `len(modules) * max_rank`
rows and a block-diagonal B, stored transposed ([width, out_features], so the kernel's expand
runs along the output features): projection i uses A rows and B columns (rows of the stored
transpose) [i * R, i * R + rank), so one shrink and one expand cover all of them. Unused rows
and columns stay zero, as does every projection an adapter does not target. Under TP, A and B
are sharded as the layer's weight is (vLLM's scheme): a column-parallel layer keeps this rank's
output features of B (A whole), a row-parallel one this rank's A columns (B whole), whose
partial deltas the layer's all-reduce sums.

Which rows use which slot is the step's `LoRAMapping`, set once per step by the model runner
(`set_lora_mapping`) for every layer to read: segments of consecutive rows that share a slot.
A step with no adapter rows has no mapping, and the layers add nothing.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator

import torch

from cluster.model.layers.lora_ops import lora_add


@dataclass(frozen=True)
class LoRAMapping:
    """Segments of the step's flat batch, int64 CPU tensors: rows [start, start + len) use `slot`."""

    seg_start: torch.Tensor
    seg_len: torch.Tensor
    seg_slot: torch.Tensor

    @classmethod
    def from_runs(cls, runs: list[tuple[int, int]]) -> "LoRAMapping | None":
        """From (slot, rows) per request in batch order (slot -1: the base model), adjacent runs
        of one slot merged; None when no row has a slot. One entry per request, not per token."""
        starts, lens, slots = [], [], []
        row = 0
        for slot, n in runs:
            if slot >= 0 and slots and slots[-1] == slot and starts[-1] + lens[-1] == row:
                lens[-1] += n
            elif slot >= 0:
                starts.append(row), lens.append(n), slots.append(slot)
            row += n
        if not slots:
            return None
        as_long = lambda xs: torch.tensor(xs, dtype=torch.long)  # noqa: E731
        return cls(as_long(starts), as_long(lens), as_long(slots))


_MAPPING: LoRAMapping | None = None


@contextlib.contextmanager
def set_lora_mapping(mapping: LoRAMapping | None) -> Iterator[None]:
    global _MAPPING
    previous, _MAPPING = _MAPPING, mapping
    try:
        yield
    finally:
        _MAPPING = previous


class LoRAStack:
    """One layer's adapter slots. `a`: [max_loras, len(modules) * max_rank, in_local];
    `b`: [max_loras, len(modules) * max_rank, out_local], each slot's B transposed (lora_ops);
    `scales`: [max_loras] fp32, shared by every layer (one adapter, one scaling)."""

    def __init__(self, modules: tuple[str, ...], max_loras: int, max_rank: int, in_features: int,
                 out_features: int, scales: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
        self.modules, self.max_rank, self.scales = modules, max_rank, scales
        width = len(modules) * max_rank
        self.a = torch.zeros(max_loras, width, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, width, out_features, dtype=dtype, device=device)

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()

    def set(self, slot: int, module: str, a: torch.Tensor, b_rows: int, b: torch.Tensor) -> None:
        """Projection `module`'s A ([rank, in_local]) and its B rows ([rows, rank], starting at
        local output row `b_rows`) into `slot`; B is stored transposed, its rows becoming the
        columns [b_rows, b_rows + rows) of the projection's rank rows of `b`."""
        first = self.modules.index(module) * self.max_rank
        rank = a.shape[0]
        self.a[slot, first:first + rank].copy_(a)
        self.b[slot, first:first + rank, b_rows:b_rows + b.shape[0]].copy_(b.T)

    def apply(self, out: torch.Tensor, x: torch.Tensor) -> None:
        """out += scale * (x A^T) B^T (= (x a^T) b, b holding B^T) for the rows of this step's
        adapters (in place)."""
        mapping = _MAPPING
        if mapping is None:
            return
        lora_add(out, x if x.is_contiguous() else x.contiguous(), self.a, self.b, mapping.seg_start,
                 mapping.seg_len, mapping.seg_slot, self.scales)
