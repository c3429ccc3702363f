"""The shrink (x A) and expand (h B) of every adapted token of a step, added to
the base layer's output, in one of two implementations:

- "rust": one extension call per layer for all tokens (`_core._lora_add`, rust/
  kernels/lora.rs): grouped by slot, on the kernel team, GIL released; CPU only.
- "torch": a pair of matrix products per adapter in the step (grouped by slot),
  or one pair on `x` itself when every token reads the same slot. The reference,
  and the path on CUDA.

Which one runs where is measured (benches/bench_lora.py, README): `choose` keeps
that choice in one place.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm import _core
from asyncllm.models.linear_kernels import as_buffer

KERNELS = ("auto", "rust", "torch")


def choose(kernel: str, device: torch.device, dtype: torch.dtype) -> str:
    """The implementation for `kernel` ("auto": rust on the CPU for float32 and
    bfloat16, where it measured faster; torch elsewhere)."""
    if kernel not in KERNELS:
        raise ValueError(f"LoRA kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    rust_ok = device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
    if kernel == "rust" and not rust_ok:
        raise ValueError(f"the rust LoRA kernel runs float32/bfloat16 on the CPU, not {dtype}")
    if kernel == "auto":
        return "rust" if rust_ok else "torch"
    return kernel


def lora_add_rust(
    y: torch.Tensor,
    x: torch.Tensor,
    a_buf: np.ndarray,
    b_buf: np.ndarray,
    token_slot: np.ndarray,
    parts: list[int],
    ranks: np.ndarray,
    num_threads: int,
) -> torch.Tensor:
    """y + the adapters' products, added into `y` itself (a fresh output of the
    base layer); `a_buf`, `b_buf` are the layer's slots as [slots * k, width] and
    [slots * width, n] buffers (`as_buffer`); `parts` the output sizes of the
    projections fused in the layer (b is read only in its diagonal blocks);
    `ranks` each slot's rank (int64; columns beyond it are padding, never read)."""
    if not y.is_contiguous():
        y = y.contiguous()
    _core._lora_add(
        as_buffer(y),
        as_buffer(x.contiguous()),
        a_buf,
        b_buf,
        token_slot,
        parts,
        ranks,
        num_threads,
    )
    return y


def lora_add_torch(
    y: torch.Tensor,
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    single: int | None,
    order: torch.Tensor | None,
    segments: tuple[tuple[int, int, int], ...],
) -> torch.Tensor:
    """y + (x A_s) B_s per token (a new tensor)."""
    if single is not None:
        return torch.addmm(y, torch.mm(x, a[single]), b[single])
    assert order is not None
    xs = x.index_select(0, order)
    delta = torch.empty(xs.shape[0], y.shape[1], dtype=y.dtype, device=y.device)
    for slot, start, end in segments:
        torch.mm(torch.mm(xs[start:end], a[slot]), b[slot], out=delta[start:end])
    return y.index_add(0, order, delta)
