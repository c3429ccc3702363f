"""LoRA on a loaded model: its projections wrapped, the host's adapters, the
device slots, and each step's tokens mapped to slots.

The runner calls `add_row` / `remove_row` as requests join and leave its batch,
and `begin_step` once per step before the forward. A step without adapted rows
costs one numpy check and leaves the model exactly as without LoRA (the layers
see `active` False; the fused decode path stays on).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from asyncllm.lora.adapters import HostAdapters, LoadedAdapter
from asyncllm.lora.kernel import choose
from asyncllm.lora.layers import LoRALinear, LoRAStep
from asyncllm.lora.slots import DeviceSlots
from asyncllm.lora.targets import find_targets

NO_SLOT = -1


class LoRAModel:
    def __init__(
        self,
        model: Any,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        max_rows: int,
        dtype: torch.dtype,
        device: torch.device,
        kernel: str = "auto",
    ) -> None:
        self.model = model
        self.device = device
        targets = find_targets(model)
        self.step = LoRAStep(choose(kernel, device, dtype), torch.get_num_threads())
        layers = []
        for t in targets:
            parent_name, _, leaf = t.name.rpartition(".")
            parent = model.get_submodule(parent_name)
            layer = LoRALinear(
                getattr(parent, leaf), t.slices, max_loras, max_lora_rank, dtype, device, self.step
            )
            setattr(parent, leaf, layer)
            layers.append(layer)
        self.host = HostAdapters(targets, max_cpu_loras, max_lora_rank, dtype)
        self.slots = DeviceSlots(layers, max_loras)
        self.row_slot = np.full(max_rows, NO_SLOT, dtype=np.int64)
        self._num_adapted_rows = 0
        # the model's fused decode path (built before this), off while a step has
        # adapted rows: its one call knows no adapters
        self._fused_decode: Any = getattr(model, "fused_decode", None)

    def add_row(self, row: int, adapter: LoadedAdapter | None) -> None:
        """A request joined the batch at `row`."""
        if adapter is None:
            self.row_slot[row] = NO_SLOT
            return
        self.row_slot[row] = self.slots.acquire(adapter)
        self._num_adapted_rows += 1

    def remove_row(self, row: int) -> None:
        slot = int(self.row_slot[row])
        if slot != NO_SLOT:
            self.slots.release(slot)
            self.row_slot[row] = NO_SLOT
            self._num_adapted_rows -= 1

    def begin_step(self, token_rows: np.ndarray) -> None:
        """Map the step's tokens (their batch rows) to slots for every layer."""
        slots = self.row_slot[token_rows] if self._num_adapted_rows else None
        adapted = None if slots is None else np.flatnonzero(slots != NO_SLOT)
        step = self.step
        if adapted is None or len(adapted) == 0:
            if step.active:  # back to the plain model, fused decode included
                step.active = False
                self.model.fused_decode = self._fused_decode
            return
        assert slots is not None
        step.active = True
        self.model.fused_decode = None  # its one call knows no adapters
        if step.kernel == "rust":
            step.token_slot = slots
            return
        first = int(slots[0])
        if len(adapted) == len(slots) and (slots == first).all():
            step.single, step.order, step.segments = first, None, ()
            return
        order = adapted[np.argsort(slots[adapted], kind="stable")]
        ordered = slots[order]
        bounds = np.flatnonzero(np.diff(ordered)) + 1
        starts = np.concatenate(([0], bounds))
        ends = np.concatenate((bounds, [len(order)]))
        step.single = None
        step.order = torch.from_numpy(order).to(self.device)
        step.segments = tuple(
            (int(ordered[s]), int(s), int(e)) for s, e in zip(starts, ends, strict=True)
        )
