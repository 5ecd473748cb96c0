"""A worker's adapter slots: `LoRAStack`s attached to every projection of the model, and the
loading of an adapter's tensors (this rank's shard of them) into one slot.

The engine decides which adapter goes into which slot (cluster/lora/slot_table.py) and says so
in the step's plan (`StepPlan.lora_loads`); the worker loads it before the step's forward. An
adapter announced earlier (`StepPlan.lora_prefetch`) was read into host memory by a background
thread meanwhile (`HOST_COPIES_PER_SLOT` x max_loras copies kept, least recently used dropped),
so the load is a copy; one not read ahead is read then.
"""
from __future__ import annotations

from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from cluster.lora.adapter import LoRAAdapter, adapter_weights
from cluster.lora.slot_table import HOST_COPIES_PER_SLOT
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
        self.host: OrderedDict[LoRAAdapter, Future] = OrderedDict()  # read ahead, least recently used first
        self.host_limit = HOST_COPIES_PER_SLOT * max_loras
        self.reader = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")

    def prefetch(self, adapter: LoRAAdapter) -> None:
        """Start reading `adapter` into host memory (no-op if it is there or on its way)."""
        if adapter in self.host:
            self.host.move_to_end(adapter)
            return
        self.host[adapter] = self.reader.submit(adapter_weights, adapter)
        while len(self.host) > self.host_limit:
            self.host.popitem(last=False)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`, replacing what was there: from its host copy (waiting for
        the read if it is still going), else read from its folder now."""
        self.prefetch(adapter)
        weights = self.host[adapter].result()
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

