"""LoRA adapters: PEFT folders read and checked (adapter.py), the engine's registry of them
(registry.py) and its slot table (slot_table.py), and a worker's slots in the model
(model_slots.py). The layers' side is cluster/model/layers/lora.py. Guide: docs/lora.md."""
from cluster.lora.adapter import LoRAAdapter, LoRAAdapterError, LoRARequest

__all__ = ["LoRAAdapter", "LoRAAdapterError", "LoRARequest"]
