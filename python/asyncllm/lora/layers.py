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

Under tensor parallelism the slots hold this rank's slice (`lora.targets`). Over a
row-parallel base (o, down: each rank multiplies its input columns, one
all-reduce sums) the adapter's share (x_r A_r) B is added to the rank's partial
product before that all-reduce: B is linear, so the sum over ranks is (x A) B and
adapters cost no collective of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch
from torch import nn

from asyncllm.lora.kernel import lora_add_rust, lora_add_torch
from asyncllm.models.linear_kernels import as_buffer

Pair = tuple[torch.Tensor, torch.Tensor]


class SlotContents(NamedTuple):
    """One slot's (a, b) of one layer, and the largest rank of its projections
    (the columns of each rank block beyond it are zero: the kernel skips them)."""

    a: torch.Tensor
    b: torch.Tensor
    rank: int


def lay_out_slot(
    pairs: list[Pair | None],
    in_features: int,
    slices: tuple[int, ...],
    max_rank: int,
    scale: float,
    dtype: torch.dtype,
) -> SlotContents | None:
    """One layer's slot contents for an adapter, laid out as `LoRALinear` stores
    them (a [in, S * R], b [S * R, out], `scale` folded into b) from its
    per-projection float32 (A [r, in], B [out_k, r]) or None; None when it adapts
    none of them. Run when the host reads the adapter, off the busy loop, so a
    slot write is a plain copy. In numpy: one thread, no OpenMP team to wait on."""
    if all(pair is None for pair in pairs):
        return None
    width = len(slices) * max_rank
    a = np.zeros((in_features, width), dtype=np.float32)
    b = np.zeros((width, sum(slices)), dtype=np.float32)
    offset = rank = 0
    for k, (size, pair) in enumerate(zip(slices, pairs, strict=True)):
        if pair is not None:
            la, lb = pair[0].numpy(), pair[1].numpy()
            rows = slice(k * max_rank, k * max_rank + la.shape[0])
            a[:, rows] = la.T
            np.multiply(lb.T, np.float32(scale), out=b[rows, offset : offset + size])
            rank = max(rank, la.shape[0])
        offset += size
    return SlotContents(torch.from_numpy(a).to(dtype), torch.from_numpy(b).to(dtype), rank)


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
        # a row-parallel base: its product before the all-reduce, which runs here
        self._partial: Callable[[torch.Tensor], torch.Tensor] | None = getattr(
            base, "partial", None
        )
        self.in_features: int = int(base.in_features)  # type: ignore[arg-type]
        self.out_features: int = int(base.out_features)  # type: ignore[arg-type]
        if sum(slices) != self.out_features:
            raise ValueError(f"slices {slices} do not add up to {self.out_features} outputs")
        self.slices = slices
        self._parts = list(slices)  # as the rust kernel takes them
        self.max_rank = max_rank
        width = len(slices) * max_rank
        shape_a, shape_b = (
            (num_slots, self.in_features, width),
            (num_slots, width, self.out_features),
        )
        # zeroed now, so every page of the slots is touched at start: a first write
        # into a slot is a copy like any later one, not page faults on the busy loop
        self.register_buffer("a", torch.zeros(shape_a, dtype=dtype, device=device))
        self.register_buffer("b", torch.zeros(shape_b, dtype=dtype, device=device))
        self.step = step
        # each slot's rank (0: empty), so the rust kernel skips the padded columns;
        # written in place (the fused decode step holds a view: kernel_operands)
        self.slot_ranks = np.zeros(num_slots, dtype=np.int64)
        # the slots as the rust kernel reads them: views made once (the slots are
        # written in place, never reallocated)
        self._a_buf = as_buffer(self.a.view(-1, width)) if step.kernel == "rust" else None
        self._b_buf = (
            as_buffer(self.b.view(-1, self.out_features)) if step.kernel == "rust" else None
        )

    def set_slot(self, slot: int, contents: SlotContents | None) -> None:
        """Write one adapter into `slot` (on the busy loop): `contents` laid out by
        `lay_out_slot` off it, so this is two plain copies; None (the adapter
        leaves this layer alone) zeroes the slot."""
        a, b = self.a[slot], self.b[slot]
        self.slot_ranks[slot] = 0 if contents is None else contents.rank
        if a.device.type != "cpu":
            for dst, src in zip((a, b), contents[:2] if contents else (None, None), strict=True):
                dst.zero_() if src is None else dst.copy_(src)
            return
        # numpy on the CPU: one thread. torch's copy_ splits a slot over the OpenMP
        # team, whose barrier waits for a descheduled thread on busy cores (12-16 ms
        # instead of 1 ms for 6 MB on the 2-core VM under load: benches/RESULTS.md).
        for dst, src in zip((a, b), contents[:2] if contents else (None, None), strict=True):
            if src is None:
                as_buffer(dst).fill(0)
            else:
                np.copyto(as_buffer(dst), as_buffer(src))

    def kernel_operands(self) -> tuple[np.ndarray, np.ndarray, list[int], np.ndarray] | None:
        """The slots as the rust kernel reads them, (a, b, parts, ranks): buffers
        written in place by `set_slot`, never reallocated, so a caller may keep
        them (the fused decode step: `lora.model`); None with the torch kernel."""
        if self._a_buf is None or self._b_buf is None:
            return None
        return self._a_buf, self._b_buf, self._parts, self.slot_ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._partial is None:
            return self._add(self.base(x), x)
        import torch.distributed as dist  # only row-parallel layers get here

        y = self._add(self._partial(x), x)
        dist.all_reduce(y)
        return y

    def _add(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y plus each adapted token's (x A_s) B_s."""
        step = self.step
        if not step.active:
            return y
        if self._a_buf is not None and self._b_buf is not None:
            return lora_add_rust(
                y,
                x,
                self._a_buf,
                self._b_buf,
                step.token_slot,
                self._parts,
                self.slot_ranks,
                step.num_threads,
            )
        return lora_add_torch(y, x, self.a, self.b, step.single, step.order, step.segments)

    def extra_repr(self) -> str:
        return f"slices={self.slices}, max_rank={self.max_rank}, slots={self.a.shape[0]}"
