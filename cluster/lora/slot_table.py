"""Which adapter sits in each of the workers' `max_loras` slots, and who holds it (engine side).

A sequence holds its adapter's slot from its first step until it finishes (through
preemption too, so a resumed sequence finds its rows where it left them). An adapter no
sequence holds stays loaded, and is the first to go, least recently used first, when another
adapter needs a slot. An adapter not in a slot is first announced to the workers, which read it
from its folder in the background; its request waits one step, and the load is then a copy in
memory rather than a disk read on the step (the scheduler's `_adapter_slot_free`). A sequence
whose adapter has no slot, and no slot can be freed, waits in the queue without holding anyone
up; it starts when a holder finishes, so there is no deadlock as long as holders run, which they
do (they already have their slots).
"""
from __future__ import annotations

from collections import OrderedDict

from cluster.lora.adapter import LoRAAdapter

# A worker keeps host copies of this many adapters per slot (model_slots.py), read ahead.
HOST_COPIES_PER_SLOT = 2


class SlotTable:
    def __init__(self, max_loras: int) -> None:
        self.slots: list[LoRAAdapter | None] = [None] * max_loras
        self.holders: dict[int, int] = {}  # slot -> sequences holding it
        self.idle: OrderedDict[int, None] = OrderedDict()  # loaded, unheld slots, least recently used first
        self.num_loads = 0

    def slot_of(self, adapter: LoRAAdapter) -> int | None:
        for i, resident in enumerate(self.slots):
            if resident == adapter:
                return i
        return None

    def can_take(self, adapter: LoRAAdapter) -> bool:
        return self.slot_of(adapter) is not None or None in self.slots or bool(self.idle)

    def take(self, adapter: LoRAAdapter) -> tuple[int, bool]:
        """Hold a slot for one sequence: (slot, whether the workers must load it there first).
        Call only when `can_take`."""
        slot = self.slot_of(adapter)
        load = slot is None
        if load:
            slot = self.slots.index(None) if None in self.slots else next(iter(self.idle))
            self.slots[slot] = adapter
            self.num_loads += 1
        self.idle.pop(slot, None)
        self.holders[slot] = self.holders.get(slot, 0) + 1
        return slot, load

    def release(self, slot: int) -> None:
        left = self.holders.pop(slot) - 1
        if left:
            self.holders[slot] = left
        else:
            self.idle[slot] = None

    def resident(self) -> list[str]:
        return [a.name for a in self.slots if a is not None]
