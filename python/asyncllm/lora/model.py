"""LoRA on a loaded model: its projections wrapped, the host's adapters, the
device slots, and each step's tokens mapped to slots.

The runner calls `add_row` / `remove_row` as requests join and leave its batch,
and `begin_step(token_slots(rows))` once per step before the forward. A step
without adapted rows costs one numpy check and leaves the model exactly as without
LoRA (the layers see `active` False). The model's fused decode step, when it has
one, takes the adapters too with the rust kernel (`FusedDecode.with_adapters`:
the same kernel on the same slots), so adapted decode steps stay on it; with the
torch kernel it is off while a step has adapted rows.

Under tensor parallelism only rank 0 has rows: it sends each step's token→slot
map and its slot writes to the other ranks (`lora.ranks`), whose `LoRAModel`s
only `begin_step` with rank 0's map.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncllm import envs
from asyncllm.lora.adapters import HostAdapters, LoadedAdapter
from asyncllm.lora.kernel import choose
from asyncllm.lora.layers import LoRALinear, LoRAStep
from asyncllm.lora.slots import DeviceSlots
from asyncllm.lora.targets import find_targets

if TYPE_CHECKING:
    from asyncllm.config import EngineConfig

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
        # the model's fused decode path (built before this): with the rust kernel
        # it adds the adapters itself; else it is off while a step has adapted rows
        fused: Any = getattr(model, "fused_decode", None)
        self._fused_adapts = fused is not None and self.step.kernel == "rust"
        if self._fused_adapts:
            fused = model.fused_decode = fused.with_adapters(_fused_adapters(model))
        self._fused_decode = fused

    @classmethod
    def for_engine(cls, model: Any, config: EngineConfig, device: torch.device) -> LoRAModel:
        """LoRA on `model` as `config.lora` says (every tensor-parallel rank alike)."""
        lora = config.lora
        if lora is None:
            raise ValueError("EngineConfig.lora is None: enable_lora is off")
        return cls(
            model,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank,
            max_cpu_loras=lora.max_cpu_loras,
            max_rows=config.max_num_seqs,
            dtype=config.torch_dtype,
            device=device,
            kernel=envs.lora_kernel(),
        )

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

    def token_slots(self, token_rows: np.ndarray) -> np.ndarray | None:
        """Each of the step's tokens' slot (NO_SLOT: the base model) from its batch
        row; None when no token has an adapter."""
        if not self._num_adapted_rows:
            return None
        slots = self.row_slot[token_rows]
        return slots if (slots != NO_SLOT).any() else None

    def begin_step(self, slots: np.ndarray | None) -> None:
        """Set the step's token→slot map (`token_slots`; None: no adapted token)
        for every layer."""
        step = self.step
        if slots is None:
            if step.active:  # back to the plain model, fused decode included
                step.active = False
                self.model.fused_decode = self._fused_decode
                if self._fused_adapts:
                    self._fused_decode.lora_slots = None
            return
        step.active = True
        if self._fused_adapts:
            self._fused_decode.lora_slots = slots
        else:
            self.model.fused_decode = None  # its one call knows no adapters
        if step.kernel == "rust":
            step.token_slot = slots
            return
        adapted = np.flatnonzero(slots != NO_SLOT)
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


def _fused_adapters(model: Any) -> list[tuple[Any, ...]]:
    """Each decoder layer's adapters for the fused decode step: for its qkv, o,
    gate_up and down projections, the slots as the rust kernel reads them, or None
    (a projection without adapters)."""

    def operands(linear: Any) -> Any:
        return linear.kernel_operands() if isinstance(linear, LoRALinear) else None

    return [
        tuple(
            operands(p)
            for p in (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
        )
        for layer in model.layers
    ]
