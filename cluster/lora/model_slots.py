"""A worker's adapter slots: `LoRAStack`s attached to every projection of the model, and the
loading of an adapter's tensors (this rank's shard of them) into one slot.

The engine decides which adapter goes into which slot (cluster/lora/slot_table.py) and says so
in the step's plan (`StepPlan.lora_loads`); the worker loads it before the step's forward.
"""
from __future__ import annotations

import torch
from torch import nn

from cluster.lora.adapter import LoRAAdapter, adapter_weights
from cluster.model.layers.linear import LinearBase, RowParallelLinear
from cluster.model.layers.lora import LoRAStack

# Our layer -> (the projections it merges, each one's shard id in the layer's weight loader).
_MERGED = {"qkv_proj": (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")),
           "o_proj": (("o_proj", None),),
           "gate_up_proj": (("gate_proj", 0), ("up_proj", 1)),
           "down_proj": (("down_proj", None),)}


class ModelLoRASlots:
    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        param = next(model.parameters())
        self.scales = torch.zeros(max_loras, dtype=torch.float32)
        # (layer index, our layer name) -> the linear, for every adaptable projection.
        self.linears: dict[tuple[int, str], LinearBase] = {}
        for i, layer in enumerate(model.model.layers):
            for name, linear in (("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj),
                                 ("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)):
                modules = tuple(m for m, _ in _MERGED[name])
                linear.lora = LoRAStack(modules, max_loras, max_rank, linear.in_features, linear.out_features,
                                        self.scales, param.dtype, param.device)
                self.linears[(i, name)] = linear
        self.resident: list[str | None] = [None] * max_loras  # adapter name per slot, for errors and tests

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` (read from its folder now) into `slot`, replacing what was there."""
        weights = adapter_weights(adapter)
        for linear in self.linears.values():
            linear.lora.clear(slot)
        for (i, name), linear in self.linears.items():
            for module, shard_id in _MERGED[name]:
                ab = weights.get((i, module))
                if ab is None:
                    continue
                a, b = ab
                if isinstance(linear, RowParallelLinear):
                    linear.lora.set(slot, module, linear.local_cols(a), 0, b)
                else:
                    offset, rows = linear.local_rows(b, shard_id)
                    linear.lora.set(slot, module, a, offset, rows)
        self.scales[slot] = adapter.scaling
        self.resident[slot] = adapter.name

