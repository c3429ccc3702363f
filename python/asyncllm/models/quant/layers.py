"""A linear layer whose weight stays int8 or packed int4 in memory.

`QuantLinear` holds what compressed-tensors checkpoints hold and what
`--quantization int8|int4` makes at load:

    qweight  int8 [out, in] (8 bits), or uint8 [out, in / 2] (4 bits: element 2j in
             the low nibble of byte j, element 2j + 1 in the high one, each stored
             as q + 8, which is compressed-tensors' int32 packing read as bytes)
    scales   float32 [out, groups]: w = (q - zero) * scale within each group of
             `in / groups` consecutive inputs (one group: per-channel scales)
    zeros    int8 [out, groups] or None (symmetric)

Two ways to use the weight, both the checked reference for the faster integer
kernels of later work:

    weight-only (W8A16, W4A16): a tile of W's rows is dequantized to float32 (then
        x's dtype) and the float GEMM runs on it, so the whole float weight never
        exists at once
    dynamic int8 activations (W8A8, as vLLM runs them): each row of x is quantized
        symmetrically with its own scale absmax / 127 (x * 127 / absmax rounded half
        to even, saturated to [-128, 127]); the integer products are summed (exactly,
        in int32, by `torch._int_mm` on the CPU) and scaled by the row's scale times
        the output channel's scale
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

# Elements of W dequantized per tile: 4M float32 (16 MiB, transient); as for the
# GGUF layers, fewer and larger GEMM calls measured faster than cache-sized tiles.
TILE_ELEMENTS = 1 << 22


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [rows, n / 2] of two 4-bit values each -> int8 [rows, n] in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).view(packed.shape[0], -1)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 [rows, n] in [-8, 7] (n even) -> uint8 [rows, n / 2] (see `unpack_int4`)."""
    u = (q.to(torch.int16) + 8).to(torch.uint8).view(q.shape[0], -1, 2)
    return u[..., 0] | (u[..., 1] << 4)


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic per-token symmetric int8, as vLLM's `scaled_int8_quant` does it:
    (int8 rows, float32 scale per row). An all-zero row gets scale 0 and zeros."""
    xf = x.float()
    absmax = xf.abs().amax(dim=1)
    scale = absmax / 127.0
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    q = torch.round(xf * inv[:, None]).clamp_(-128, 127).to(torch.int8)
    return q, scale


class QuantLinear(nn.Module):
    """`y = x Wᵀ + b` over an int8 or packed int4 weight (see the module docstring)."""

    def __init__(
        self,
        qweight: torch.Tensor,
        bits: int,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        in_features: int,
        bias: torch.Tensor | None = None,
        act_quant: bool = False,
    ) -> None:
        super().__init__()
        _check(qweight, bits, scales, zeros, in_features, act_quant)
        self.bits, self.in_features, self.act_quant = bits, in_features, act_quant
        self.out_features = qweight.shape[0]
        self.group_size = in_features // scales.shape[1]
        self.qweight: torch.Tensor
        self.scales: torch.Tensor
        self.zeros: torch.Tensor | None
        self.register_buffer("qweight", qweight.contiguous(), persistent=False)
        self.register_buffer("scales", scales.float().contiguous(), persistent=False)
        self.register_buffer("zeros", None if zeros is None else zeros.contiguous(), False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.tile_rows = max(1, TILE_ELEMENTS // in_features)

    def int_rows(self, start: int, stop: int) -> torch.Tensor:
        """The integers q of weight rows [start, stop) as int8 [rows, in]."""
        q = self.qweight[start:stop]
        return q if self.bits == 8 else unpack_int4(q)

    def dequantize_rows(self, start: int, stop: int) -> torch.Tensor:
        """Weight rows [start, stop) in float32: (q - zero) * scale per group."""
        q = self.int_rows(start, stop).float().view(stop - start, -1, self.group_size)
        if self.zeros is not None:
            q = q - self.zeros[start:stop, :, None].float()
        return (q * self.scales[start:stop, :, None]).view(stop - start, self.in_features)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole float weight [out, in] (tests and reference models)."""
        return self.dequantize_rows(0, self.out_features).to(dtype)

    def weight_bytes(self) -> int:
        """Bytes the weight occupies in memory (integers, scales and zero points)."""
        tensors = [self.qweight, self.scales] + ([] if self.zeros is None else [self.zeros])
        return sum(t.numel() * t.element_size() for t in tensors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self._int8_act(rows) if self.act_quant else self._weight_only(rows)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _weight_only(self, rows: torch.Tensor) -> torch.Tensor:
        outs = []
        for start in range(0, self.out_features, self.tile_rows):
            stop = min(start + self.tile_rows, self.out_features)
            w = self.dequantize_rows(start, stop)
            outs.append(F.linear(rows, w if rows.dtype == w.dtype else w.to(rows.dtype)))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    def _int8_act(self, rows: torch.Tensor) -> torch.Tensor:
        q, row_scale = quantize_rows_int8(rows)
        acc = _int_matmul(q, self.qweight)
        out = acc * row_scale[:, None] * self.scales[:, 0][None, :]
        return out if rows.dtype == torch.float32 else out.to(rows.dtype)

    def extra_repr(self) -> str:
        kind = "w8a8" if self.act_quant else f"w{self.bits}a16"
        zero = "asymmetric" if self.zeros is not None else "symmetric"
        return (
            f"in={self.in_features}, out={self.out_features}, {kind}, "
            f"group={self.group_size}, {zero}"
        )


class RowParallelQuantLinear(QuantLinear):
    """A row-parallel slice (its rank's input columns, models/parallel_layers): the
    partial products of every rank summed in one all-reduce. No bias."""

    @classmethod
    def of(cls, layer: QuantLinear) -> RowParallelQuantLinear:
        return cls(layer.qweight, layer.bits, layer.scales, layer.zeros, layer.in_features)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """The rank's product before the all-reduce (where LoRA adds its share)."""
        return super().forward(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.partial(x)
        dist.all_reduce(out)
        return out


def _int_matmul(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """q · qweightᵀ summed exactly, as float32 [rows, out]: `torch._int_mm` (int32
    sums) on the CPU, 3-40x faster there than the float GEMM on the integers as
    float32 over SmolLM2's shapes at 1-256 rows (benches/RESULTS.md); elsewhere the
    float GEMM, exact until a sum passes 2^24."""
    if q.device.type == "cpu":
        return torch._int_mm(q, qweight.t()).float()
    return F.linear(q.float(), qweight.float())


def _check(
    qweight: torch.Tensor,
    bits: int,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    in_features: int,
    act_quant: bool,
) -> None:
    """ValueError naming the field whose shape or dtype does not fit the others."""
    if bits not in (4, 8):
        raise ValueError(f"bits={bits}: QuantLinear supports 4 and 8")
    want = (torch.int8, in_features) if bits == 8 else (torch.uint8, in_features // 2)
    if qweight.dim() != 2 or (qweight.dtype, qweight.shape[1]) != want:
        raise ValueError(
            f"qweight {qweight.dtype} {tuple(qweight.shape)}: {bits}-bit rows of "
            f"{in_features} need {want[0]} [out, {want[1]}]"
        )
    out = qweight.shape[0]
    if scales.dim() != 2 or scales.shape[0] != out or in_features % scales.shape[1]:
        raise ValueError(
            f"scales {tuple(scales.shape)}: need [{out}, groups] with groups dividing "
            f"in_features={in_features}"
        )
    if zeros is not None and (zeros.shape != scales.shape or zeros.dtype != torch.int8):
        raise ValueError(f"zeros {zeros.dtype} {tuple(zeros.shape)}: need int8 like scales")
    if act_quant and (bits != 8 or scales.shape[1] != 1 or zeros is not None):
        raise ValueError(
            "dynamic int8 activations need 8-bit symmetric weights with one scale per "
            f"output channel (got bits={bits}, groups={scales.shape[1]}, "
            f"zero points={'yes' if zeros is not None else 'no'})"
        )
