"""The kernels a linear layer can run on the CPU, and the layer that runs the ones
chosen for it.

    torch    `F.linear` (MKL's or oneDNN's GEMM, as torch dispatches it)
    onednn   torch's own oneDNN linear on a weight reordered once into its blocked
             layout (`torch.ops.mkldnn._linear_pointwise`), what established CPU
             engines run; on some CPUs 2-4x `F.linear` (AMD, where MKL skips AVX-512)
    rust     the extension's matrix-vector kernel (rust/kernels/linear.rs): one read
             of the weight for a step's few rows, and one reduction order for every
             row count (batch invariance)

Which kernel runs depends on the rows of the step: `KernelLinear` keeps a table from
row-count bucket to kernel, filled by `asyncllm.worker.linear_select` from a short
measurement when the model loads. A weight lives in one layout only: the reordered
one (onednn serves every bucket) or the checkpoint's (torch and rust share it), so
choosing a kernel never costs a second copy of the weights.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from functools import cache, partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import _core
from asyncllm.models import kernel_rows

KERNELS = ("torch", "onednn", "rust")
# Row counts a choice is made for: a step of T rows takes the first bucket >= T
# (the last one beyond it).
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Above this many rows the rust kernel (a matrix-vector product) is never chosen by
# measurement: it reads the weight once per step but does the FLOPs without a GEMM's
# blocking, so it only wins while the weight read dominates.
RUST_MAX_ROWS = 16


@cache
def onednn_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether this torch build and this CPU run the oneDNN linear ops in `dtype`.

    CPU builds of torch 2.x have them, but oneDNN's bf16 reorder refuses a CPU
    without AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT (an AVX2-only EPYC, say): a tiny
    reorder and product, tried once per dtype, tell."""
    if not (
        torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    try:
        with torch.inference_mode():
            packed = pack_onednn(torch.zeros(8, 8, dtype=dtype))
            run_onednn(torch.zeros(1, 8, dtype=dtype), packed, None)
    except RuntimeError:
        return False
    return True


def pack_onednn(weight: torch.Tensor) -> torch.Tensor:
    """The weight reordered into oneDNN's blocked layout (an opaque tensor that only
    `_linear_pointwise` reads)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)  # type: ignore[no-any-return]


def run_onednn(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]


def as_buffer(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor as the buffer the extension reads: float32 as it is, bfloat16 as
    its bits (int16; numpy has no bfloat16)."""
    return (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).numpy()


def run_rust(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_threads: int,
    weight_buffer: np.ndarray | None = None,
    bias_buffer: np.ndarray | None = None,
) -> torch.Tensor:
    """`_core._linear` on CPU tensors: float32, or bfloat16 passed as int16 bits.
    `weight_buffer` / `bias_buffer`: the weight's and the float32 bias's buffers,
    made once by a layer that calls this every step."""
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=x.dtype)
    if bias is not None and bias_buffer is None:
        bias_buffer = bias.float().numpy()
    if weight_buffer is None:
        weight_buffer = as_buffer(weight)
    _core._linear(as_buffer(out), as_buffer(x), weight_buffer, bias_buffer, num_threads)
    return out


def rust_supports(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)


class KernelLinear(nn.Module):
    """`y = x Wᵀ + b` through the kernel chosen for the step's row count.

    `kernels[i]` serves steps of up to `BUCKETS[i]` rows (the last one beyond).
    Built by `asyncllm.worker.linear_select` from a layer's weight, which it takes
    over: reordered for oneDNN when that is the choice (then for every bucket),
    else the very same tensor (a tied LM head shares the embedding's)."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        kernels: Sequence[str],
        num_threads: int,
    ) -> None:
        super().__init__()
        if len(kernels) != len(BUCKETS) or not set(kernels) <= set(KERNELS):
            raise ValueError(f"kernels must name one of {KERNELS} per bucket {BUCKETS}")
        if "onednn" in kernels and set(kernels) != {"onednn"}:
            raise ValueError("a reordered (onednn) weight serves every bucket alone")
        self.out_features, self.in_features = weight.shape
        self.kernels = tuple(kernels)
        self.num_threads = num_threads
        if kernels[0] == "onednn":
            weight = nn.Parameter(pack_onednn(weight), requires_grad=False)
        elif not isinstance(weight, nn.Parameter):
            weight = nn.Parameter(weight, requires_grad=False)
        self.weight = weight
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        # The rust kernel's operands that do not change, as buffers, made once.
        self._w_buf = as_buffer(weight.detach()) if "rust" in kernels else None
        self._b_buf = None if self.bias is None else self.bias.detach().float().numpy()
        runners = {k: self._runner(k) for k in set(self.kernels)}
        # The kernel of every row count up to the last bucket, looked up by index on
        # the per-step path (beyond it: the last bucket's).
        self._by_rows: tuple[Callable[[torch.Tensor], torch.Tensor], ...] = tuple(
            runners[self.kernels[min(bisect.bisect_left(BUCKETS, r), len(BUCKETS) - 1)]]
            for r in range(BUCKETS[-1] + 1)
        )

    def _runner(self, kernel: str) -> Callable[[torch.Tensor], torch.Tensor]:
        if kernel == "onednn":
            return partial(_onednn_of, self)
        if kernel == "rust":
            return partial(_rust_of, self)
        return partial(_torch_of, self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:
            return self._by_rows[min(kernel_rows.rows or x.shape[0], BUCKETS[-1])](x)
        rows = x.reshape(-1, x.shape[-1])
        out = self._by_rows[min(kernel_rows.rows or rows.shape[0], BUCKETS[-1])](rows)
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kernels={self.kernels}"


def _torch_of(layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _onednn_of(layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    return run_onednn(x, layer.weight, layer.bias)


def _rust_of(layer: KernelLinear, x: torch.Tensor) -> torch.Tensor:
    return run_rust(x, layer.weight, layer.bias, layer.num_threads, layer._w_buf, layer._b_buf)
