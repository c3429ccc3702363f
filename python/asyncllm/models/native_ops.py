"""The elementwise work between a layer's matmuls on the extension's row-wise
kernels (rust/kernels/elementwise.rs, silu_mul.rs, rotary.rs): RMSNorm, the
residual add with the next norm, SiLU × up and rotary embedding, in one pass each,
rows shared out over the kernel threads.

Why: the torch path runs a bfloat16 RMSNorm as seven ops, each a pass over memory
and a dispatch (measured at 256 rows of 512, one thread: 109 µs against 276 for
bf16, 100 against 222 for fp32). The kernels compute in float32 and round
where the torch path rounds, the same row functions the fused decode step runs
(models/fused_decode.py); a row's result never depends on the rows beside it.
The model runner gives these ops to the layers on CPU float32 and bfloat16 models
(`use_native_ops`).
"""

from __future__ import annotations

import torch
from torch import nn

from asyncllm import _core
from asyncllm.models.layers import EAGER_OPS, FusedOps, set_ops
from asyncllm.models.linear_kernels import as_buffer

DTYPES = (torch.float32, torch.bfloat16)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype not in DTYPES or x.dtype != weight.dtype:
        return EAGER_OPS.rms_norm(x, weight, eps)
    x = x.contiguous()
    out = torch.empty_like(x)
    _core._rms_norm(as_buffer(out), as_buffer(x), as_buffer(weight), eps, torch.get_num_threads())
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x); the sum is a new tensor, as on the
    torch path (the caller's residual is not written)."""
    if x.dtype not in DTYPES or not x.dtype == residual.dtype == weight.dtype:
        return EAGER_OPS.add_rms_norm(x, residual, weight, eps)
    summed = residual.contiguous().clone()
    out = torch.empty_like(summed)
    _core._add_rms_norm(
        as_buffer(out),
        as_buffer(summed),
        as_buffer(x.contiguous()),
        as_buffer(weight),
        eps,
        torch.get_num_threads(),
    )
    return out, summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused gate/up output [T, 2 * I], in one pass."""
    if gate_up.dtype not in DTYPES:
        return EAGER_OPS.silu_mul(gate_up)
    gate_up = gate_up.contiguous()
    inter = gate_up.shape[-1] // 2
    out = gate_up.new_empty((*gate_up.shape[:-1], inter))
    _core._silu_mul(as_buffer(out), as_buffer(gate_up), inter, torch.get_num_threads())
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rotary of x [T, H, D] (heads at the front of rows of a larger tensor,
    such as the q and k of the fused q/k/v output) in one pass; a new tensor."""
    if not _rows_of_heads(x) or x.dtype not in DTYPES or not x.dtype == cos.dtype == sin.dtype:
        return EAGER_OPS.rotary(x, cos, sin)
    tokens, heads, head_dim = x.shape
    rows = x.as_strided((tokens, x.stride(0)), (x.stride(0), 1))
    out = x.new_empty((tokens, heads, head_dim))
    _core._rotary(
        as_buffer(out),
        as_buffer(rows),
        as_buffer(cos.reshape(tokens, head_dim // 2).contiguous()),
        as_buffer(sin.reshape(tokens, head_dim // 2).contiguous()),
        heads,
        head_dim,
        torch.get_num_threads(),
    )
    return out


def _rows_of_heads(x: torch.Tensor) -> bool:
    """Whether x [T, H, D] is contiguous heads at the start of equal rows of one
    buffer that ends with its last row (what the kernel reads)."""
    if x.dim() != 3 or x.shape[0] == 0 or x.shape[2] % 2:
        return False
    tokens, heads, head_dim = x.shape
    row = x.stride(0)
    end = x.storage_offset() + tokens * row
    return bool(
        x.stride(2) == 1
        and x.stride(1) == head_dim
        and row >= heads * head_dim
        and end <= x.untyped_storage().nbytes() // x.element_size()
    )


NATIVE_OPS = FusedOps(
    rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_mul=silu_mul, rotary=rotary
)


def use_native_ops(model: nn.Module) -> int:
    """Give the layers of a CPU float32 / bfloat16 model the native ops (those
    still on the eager ones); returns how many modules took them."""
    weight = next(model.parameters())
    if weight.device.type != "cpu" or weight.dtype not in DTYPES:
        return 0
    return set_ops(model, NATIVE_OPS, only_replacing=EAGER_OPS)
