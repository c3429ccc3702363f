"""The LoRA kernels against a plain per-token reference: the rust one (float32 and
bfloat16, every ISA the CPU has) and the torch one, on mixed slots with base rows,
one slot for all rows, and padded ranks, for a layer fusing three projections (B
block-diagonal, as laid out; the rust kernel never reads off its blocks); and the
rust one's checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm import _core
from asyncllm.lora.kernel import lora_add_rust, lora_add_torch
from asyncllm.models.linear_kernels import as_buffer

SLOTS, K, WIDTH, N = 4, 40, 24, 52
PARTS = [20, 16, 16]  # three fused projections' outputs: rank blocks of 8
FULL = np.full(SLOTS, 8, dtype=np.int64)  # every slot's rank: the whole block


def _operands(dtype: torch.dtype, tokens: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, K, generator=g).to(dtype)
    y = torch.randn(tokens, N, generator=g).to(dtype)
    a = (torch.randn(SLOTS, K, WIDTH, generator=g) * 0.3).to(dtype)
    b = (torch.randn(SLOTS, WIDTH, N, generator=g) * 0.3).to(dtype)
    a[2, :, 10:] = 0  # a slot whose adapter has a smaller rank: zero padding
    b[2, 10:] = 0
    return x, y, a, b * _blocks(dtype)


def _blocks(dtype: torch.dtype) -> torch.Tensor:
    """1 in B's diagonal blocks (rank block p by part p's columns), 0 elsewhere."""
    mask = torch.zeros(WIDTH, N, dtype=dtype)
    rank, lo = WIDTH // len(PARTS), 0
    for p, size in enumerate(PARTS):
        mask[p * rank : (p + 1) * rank, lo : lo + size] = 1
        lo += size
    return mask


def _nan_off_blocks(b: torch.Tensor) -> np.ndarray:
    """b's buffer with NaN off its diagonal blocks: a kernel reading them fails."""
    return as_buffer(torch.where(_blocks(b.dtype).bool(), b, torch.nan).view(-1, N))


def _reference(x, y, a, b, slots: np.ndarray) -> torch.Tensor:
    out = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            out[t] += (x[t].double() @ a[s].double()) @ b[s].double()
    return out


def _segments(slots: np.ndarray):
    adapted = np.flatnonzero(slots >= 0)
    order = adapted[np.argsort(slots[adapted], kind="stable")]
    segs, start = [], 0
    for s in sorted(set(slots[adapted].tolist())):
        end = start + int((slots[adapted] == s).sum())
        segs.append((s, start, end))
        start = end
    return torch.from_numpy(order), tuple(segs)


CASES = {
    "mixed": np.array([1, -1, 3, 1, 0, 2, -1, 2, 2, 3, 0, 1, -1], dtype=np.int64),
    "one-slot": np.full(9, 2, dtype=np.int64),
    "decode-1": np.array([3], dtype=np.int64),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_rust_and_torch_equal_the_reference(case: str, dtype: torch.dtype, threads: int) -> None:
    slots = CASES[case]
    x, y, a, b = _operands(dtype, len(slots))
    ref = _reference(x, y, a, b, slots)
    tol = 1e-4 if dtype == torch.float32 else 0.05
    a_buf, b_buf = as_buffer(a.view(-1, WIDTH)), _nan_off_blocks(b)
    rust = lora_add_rust(y.clone(), x, a_buf, b_buf, slots, PARTS, FULL, threads)
    torch.testing.assert_close(rust.double(), ref, rtol=tol, atol=tol)
    order, segs = _segments(slots)
    single = int(slots[0]) if (slots == slots[0]).all() else None
    out = lora_add_torch(y.clone(), x, a, b, single, order, segs)
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_a_token_does_not_depend_on_its_neighbours() -> None:
    slots = CASES["mixed"]
    x, y, a, b = _operands(torch.float32, len(slots))
    a_buf, b_buf = as_buffer(a.view(-1, WIDTH)), as_buffer(b.view(-1, N))
    batch = lora_add_rust(y.clone(), x, a_buf, b_buf, slots, PARTS, FULL, 2)
    for t in (0, 4, 9):
        one = (y[t : t + 1].clone(), x[t : t + 1], a_buf, b_buf, slots[t : t + 1], PARTS, FULL, 1)
        alone = lora_add_rust(*one)
        assert torch.equal(alone[0], batch[t])


def test_rust_kernel_checks_before_writing() -> None:
    x, y, a, b = _operands(torch.float32, 3)
    a_buf, b_buf = as_buffer(a.view(-1, WIDTH)), as_buffer(b.view(-1, N))
    before = y.clone()
    yb, xb = as_buffer(y), as_buffer(x)
    with pytest.raises(ValueError, match="token 1 has slot 4, not in -1..4"):
        _core._lora_add(yb, xb, a_buf, b_buf, np.array([0, 4, 1]), PARTS, FULL, 1)
    with pytest.raises(ValueError, match="one slot per token"):
        _core._lora_add(yb, xb, a_buf, b_buf, np.array([0, 1]), PARTS, FULL, 1)
    with pytest.raises(ValueError, match=r"parts \[20, 16\] must split n=52"):
        _core._lora_add(yb, xb, a_buf, b_buf, np.zeros(3, np.int64), [20, 16], FULL, 1)
    with pytest.raises(ValueError, match="a rank of at most 8"):
        high = np.full(SLOTS, 9, dtype=np.int64)
        _core._lora_add(yb, xb, a_buf, b_buf, np.zeros(3, np.int64), PARTS, high, 1)
    with pytest.raises(ValueError, match="a negative rank"):
        _core._lora_add(yb, xb, a_buf, b_buf, np.zeros(3, np.int64), PARTS, -FULL, 1)
    with pytest.raises(ValueError, match="share a dtype"):
        xh = as_buffer(x.bfloat16())
        _core._lora_add(yb, xh, a_buf, b_buf, np.zeros(3, np.int64), PARTS, FULL, 1)
    assert torch.equal(y, before)
