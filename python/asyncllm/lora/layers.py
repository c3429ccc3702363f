"""The linear layer with per-row adapters: y = base(x) + (x A_s) B_s for the
adapter s of each row (none for base-model rows).

Its adapters sit in `num_slots` device slots, stored for the two products a step
runs per adapter: `a[s]` [in, S * R] (the S fused projections' A, each R wide
where R is `max_lora_rank`, transposed) and `b[s]` [S * R, out], block-diagonal
(projection k's B, scaled, in rows k*R.. and its own output columns). A smaller
rank is padded with zeros, which add nothing, so one shape serves every adapter
and a fused q/k/v projection costs two products, not six.

Which slot each token of the step reads is one `LoRAStep` shared by every layer,
set once per step (`lora.model.LoRAModel.begin_step`): the layers only read it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from asyncllm.lora.kernel import lora_add_rust, lora_add_torch
from asyncllm.models.linear_kernels import as_buffer


class LoRAStep:
    """The step's tokens as the layers see them: `active` (any token has an
    adapter); for the rust kernel `token_slot` (each token's slot, -1: none); for
    the torch one `single` (every token reads this slot: the products run on `x`
    itself), else `order` (the adapted tokens, grouped by slot) and `segments`
    ((slot, start, end) of each group within `order`). `kernel` and `num_threads`
    are fixed when the model is set up (`lora.kernel.choose`)."""

    __slots__ = ("active", "kernel", "num_threads", "token_slot", "single", "order", "segments")

    def __init__(self, kernel: str, num_threads: int) -> None:
        self.active = False
        self.kernel = kernel
        self.num_threads = num_threads
        self.token_slot = np.empty(0, dtype=np.int64)
        self.single: int | None = None
        self.order: torch.Tensor | None = None
        self.segments: tuple[tuple[int, int, int], ...] = ()


class LoRALinear(nn.Module):
    """`base` (any linear layer: float, kernel-selected, GGUF or int8/int4) with
    adapters; `slices` are the output sizes of the projections fused in it."""

    a: torch.Tensor
    b: torch.Tensor

    def __init__(
        self,
        base: nn.Module,
        slices: tuple[int, ...],
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        step: LoRAStep,
    ) -> None:
        super().__init__()
        self.base = base
        self.in_features: int = int(base.in_features)  # type: ignore[arg-type]
        self.out_features: int = int(base.out_features)  # type: ignore[arg-type]
        if sum(slices) != self.out_features:
            raise ValueError(f"slices {slices} do not add up to {self.out_features} outputs")
        self.slices = slices
        self.max_rank = max_rank
        width = len(slices) * max_rank
        shape_a, shape_b = (
            (num_slots, self.in_features, width),
            (num_slots, width, self.out_features),
        )
        self.register_buffer("a", torch.zeros(shape_a, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(shape_b, dtype=dtype, device=device))
        self.step = step
        # the slots as the rust kernel reads them: views made once (the slots are
        # written in place, never reallocated)
        self._a_buf = as_buffer(self.a.view(-1, width)) if step.kernel == "rust" else None
        self._b_buf = (
            as_buffer(self.b.view(-1, self.out_features)) if step.kernel == "rust" else None
        )

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter into `slot`: per fused projection (A [r, in], scaled
        B [out_k, r]) or None where the adapter leaves it alone."""
        a, b, r_max = self.a[slot], self.b[slot], self.max_rank
        a.zero_()
        b.zero_()
        offset = 0
        for k, (size, pair) in enumerate(zip(self.slices, pairs, strict=True)):
            if pair is not None:
                la, lb = pair
                r = la.shape[0]
                a[:, k * r_max : k * r_max + r] = la.t()
                b[k * r_max : k * r_max + r, offset : offset + size] = lb.t()
            offset += size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.base(x)
        step = self.step
        if not step.active:
            return y
        if self._a_buf is not None and self._b_buf is not None:
            return lora_add_rust(y, x, self._a_buf, self._b_buf, step.token_slot, step.num_threads)
        return lora_add_torch(y, x, self.a, self.b, step.single, step.order, step.segments)

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_rank={self.max_rank}, slots={self.a.shape[0]}"
