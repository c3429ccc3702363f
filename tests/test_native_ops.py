"""The extension's row-wise elementwise ops (models/native_ops.py): the eager ops'
results in float32 and bfloat16 (bf16 within a unit in the last place: exp and the
square root are Rust's), a row's bits independent of the rows beside it and of the
thread count, the eager ops for other dtypes, and clear errors."""

from __future__ import annotations

import pytest
import torch

from asyncllm import _core
from asyncllm.models import native_ops
from asyncllm.models.layers import EAGER_OPS
from asyncllm.models.linear_kernels import as_buffer

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_native_ops_give_the_eager_ops_results(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=g).to(dtype)
    res = torch.randn(rows, 96, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=g)).to(dtype)
    torch.testing.assert_close(
        native_ops.rms_norm(x, w, 1e-6), EAGER_OPS.rms_norm(x, w, 1e-6), **TOL[dtype]
    )
    res_before = res.clone()
    got, want = native_ops.add_rms_norm(x, res, w, 1e-6), EAGER_OPS.add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(res, res_before)  # the caller's residual is not written
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)  # the sum rounds alike
    torch.testing.assert_close(got[0], want[0], **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 100])
def test_silu_mul_gives_the_eager_result(dtype: torch.dtype, rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    # gates far into both tails too: exp must neither overflow nor lose the sign
    gate_up = (6 * torch.randn(rows, 2 * 136, generator=g)).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, -30.0, 30.0, 100.0]).to(dtype)
    got = native_ops.silu_mul(gate_up)
    assert got.shape == (rows, 136) and got.dtype == dtype
    torch.testing.assert_close(got, EAGER_OPS.silu_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 9, 70])
def test_rotary_gives_the_eager_bits(dtype: torch.dtype, tokens: int) -> None:
    """Rotary of the q and k heads read in place from the fused q/k/v output (a
    strided view), and of a contiguous tensor: the same bits as the torch ops
    (each product and sum rounded where they round, nothing fused)."""
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, head_dim = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim)
    cs = torch.randn(tokens, 2, head_dim // 2, generator=g).to(dtype)
    cos, sin = cs[:, 0:1], cs[:, 1:2]
    for x in (qk, qk.contiguous()):
        got = native_ops.rotary(x, cos, sin)
        assert got.shape == x.shape and got.is_contiguous()
        assert torch.equal(got, EAGER_OPS.rotary(x, cos, sin))
    # a view the kernel cannot read (partial rotary's slice) takes the torch ops
    part = qk[..., :32]
    torch.testing.assert_close(
        native_ops.rotary(part, cos[..., :16], sin[..., :16]),
        EAGER_OPS.rotary(part, cos[..., :16], sin[..., :16]),
        rtol=0,
        atol=0,
    )


def test_silu_mul_rows_do_not_depend_on_neighbours_or_threads() -> None:
    g = torch.Generator().manual_seed(1)
    gate_up = torch.randn(300, 2 * 80, generator=g).to(torch.bfloat16)
    batch = native_ops.silu_mul(gate_up)
    for threads in (1, 2):
        out = torch.empty(1, 80, dtype=torch.bfloat16)
        _core._silu_mul(as_buffer(out), as_buffer(gate_up[137:138].clone()), 80, threads)
        assert torch.equal(out[0], batch[137])


def test_a_rows_bits_do_not_depend_on_its_neighbours_or_the_threads() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(64, generator=g).to(torch.bfloat16)
    batch = native_ops.rms_norm(x, w, 1e-5)
    for threads in (1, 2):
        out = torch.empty(1, 64, dtype=torch.bfloat16)
        _core._rms_norm(as_buffer(out), as_buffer(x[137:138].clone()), as_buffer(w), 1e-5, threads)
        assert torch.equal(out[0], batch[137])


def test_other_dtypes_take_the_eager_ops() -> None:
    x = torch.randn(3, 16, dtype=torch.float16)
    w = torch.ones(16, dtype=torch.float16)
    assert torch.equal(native_ops.rms_norm(x, w, 1e-6), EAGER_OPS.rms_norm(x, w, 1e-6))


def test_bad_buffers_raise_and_write_nothing() -> None:
    x, w = torch.randn(4, 8), torch.randn(8)
    out = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="whole rows"):
        _core._rms_norm(as_buffer(out), as_buffer(x), as_buffer(torch.randn(5)), 1e-6, 1)
    with pytest.raises(ValueError, match="one dtype"):
        _core._rms_norm(as_buffer(out), as_buffer(x), as_buffer(w.bfloat16()), 1e-6, 1)
    with pytest.raises(ValueError, match="overlap"):
        _core._rms_norm(as_buffer(x), as_buffer(x), as_buffer(w), 1e-6, 1)
    with pytest.raises(ValueError, match="rotary"):
        _core._rotary(as_buffer(out), as_buffer(x), as_buffer(w), as_buffer(w), 4, 7, 1)
    with pytest.raises(ValueError, match="gate and up halves"):
        _core._silu_mul(as_buffer(out), as_buffer(torch.randn(4, 8)), 8, 1)
    assert not out.any()
