"""The device slots: the `max_loras` adapters a step can read.

Invariant: a slot with rows (`refs > 0`) holds the very adapter its rows were
admitted with until they all leave; only a slot without rows is rewritten, the
least recently used first. The scheduler admits at most `max_loras` distinct
adapters among running requests, so a new request's adapter always finds a slot.
"""

from __future__ import annotations

from collections.abc import Callable

from asyncllm.lora.adapters import LoadedAdapter
from asyncllm.lora.layers import LoRALinear


class DeviceSlots:
    def __init__(self, layers: list[LoRALinear], num_slots: int) -> None:
        self.layers = layers
        self.held: list[LoadedAdapter | None] = [None] * num_slots
        self.refs = [0] * num_slots
        self._last_used = [0] * num_slots
        self._clock = 0
        self.num_loads = 0  # slot writes, for tests and stats
        # called after each slot write (rank 0 of tensor parallelism: the other
        # ranks write the same slot, lora.ranks.AdapterFeed)
        self.on_write: Callable[[int, LoadedAdapter], None] | None = None

    def acquire(self, adapter: LoadedAdapter) -> int:
        """The slot of `adapter` (written into a free slot if not held), with one
        more row reading it."""
        self._clock += 1
        held = [s for s, a in enumerate(self.held) if a is adapter]
        if held:
            slot = held[0]
        else:
            slot = self._free_slot(adapter)
            self.write(slot, adapter)
            self.held[slot] = adapter
            self.num_loads += 1
            if self.on_write is not None:
                self.on_write(slot, adapter)
        self.refs[slot] += 1
        self._last_used[slot] = self._clock
        return slot

    def write(self, slot: int, adapter: LoadedAdapter) -> None:
        """Copy `adapter` into `slot` of every layer (`acquire` chose the slot; on
        the other tensor-parallel ranks, rank 0 did)."""
        for layer, contents in zip(self.layers, adapter.contents, strict=True):
            layer.set_slot(slot, contents)

    def release(self, slot: int) -> None:
        """One row that read `slot` left the batch."""
        self.refs[slot] -= 1

    def _free_slot(self, adapter: LoadedAdapter) -> int:
        free = [s for s, r in enumerate(self.refs) if r == 0]
        if not free:
            raise RuntimeError(
                f"no free LoRA slot for {adapter.request.lora_name!r}: every one of the "
                f"{len(self.refs)} slots has running rows (the scheduler admits at most "
                "max_loras adapters)"
            )
        empty = [s for s in free if self.held[s] is None]
        return empty[0] if empty else min(free, key=self._last_used.__getitem__)
