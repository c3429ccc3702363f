"""Layers whose weights stay in GGUF blocks in memory.

`GGUFLinear` computes `y = x Wᵀ + b` in one of two ways, both reading the blocks:

    rows <= FUSED_MAX_ROWS (decode, on the CPU): the extension's `_gguf_linear`
        decodes each weight row into a cache-resident buffer and dots it with every
        row of x: the weight is read once per step, as blocks
    otherwise: a tile of W's rows at a time is dequantized (float32, then x's
        dtype) and the float GEMM runs on it, so the whole float weight never
        exists at once and a tile stays in cache between the two

Both are the checked path for every type (equal to dequantize + float32 matmul up
to float rounding); faster integer kernels plug in as other forwards of the same
layer and are tested against them.

`GGUFEmbedding` gathers the rows of the tokens it is asked for and dequantizes
only those. A tied LM head is a `GGUFLinear` over the embedding's very blocks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import _core
from asyncllm.models.gguf.dequant import BLOCK_SIZES, dequantize, row_bytes

# Elements of W dequantized per tile: 4M float32 (16 MiB, transient), so a layer
# of a small model is one tile and one GEMM. Smaller tiles (1 MiB, cache-resident)
# measured 2.5x slower over SmolLM2's linears at 64 rows (Xeon VM, loaded): each
# GEMM call costs a fixed price in thread wake-ups that many small ones multiply.
TILE_ELEMENTS = 1 << 22
# Up to this many rows the fused kernel runs (it does a dot product per weight row
# and x row: past a few rows the GEMM on dequantized tiles is faster).
FUSED_MAX_ROWS = 4


class GGUFLinear(nn.Module):
    """A linear layer over one or more row blocks of GGUF weights (a fused q/k/v
    whose parts have different types keeps one part per type)."""

    def __init__(
        self, parts: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None
    ) -> None:
        super().__init__()
        if not parts:
            raise ValueError("a GGUFLinear needs at least one part")
        self.in_features = in_features
        self.qtypes: tuple[str, ...] = tuple(q for q, _ in parts)
        for i, (qtype, raw) in enumerate(parts):
            if raw.dtype != torch.uint8 or raw.shape[1] != row_bytes(qtype, in_features):
                raise ValueError(f"part {i}: {qtype} rows of {in_features} need uint8 rows")
            self.register_buffer(f"part{i}", raw, persistent=False)
        self.out_features = sum(raw.shape[0] for _, raw in parts)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.tile_rows = max(1, TILE_ELEMENTS // in_features)

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        return [(q, getattr(self, f"part{i}")) for i, q in enumerate(self.qtypes)]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole float weight [out, in] (tests, and a bf16 copy for benchmarks)."""
        return torch.cat([dequantize(raw, q) for q, raw in self.parts()]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        fused = rows.device.type == "cpu" and rows.shape[0] <= FUSED_MAX_ROWS
        outs = []
        for qtype, raw in self.parts():
            if fused:
                outs.append(_fused(qtype, rows, raw))
                continue
            for start in range(0, raw.shape[0], self.tile_rows):
                w = dequantize(raw[start : start + self.tile_rows], qtype)
                outs.append(F.linear(rows, w if rows.dtype == w.dtype else w.to(rows.dtype)))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={self.qtypes}"


def _fused(qtype: str, rows: torch.Tensor, raw: torch.Tensor) -> torch.Tensor:
    """x · Wᵀ by the extension's kernel on the blocks (float32 in and out)."""
    x = rows.float().contiguous()
    out = torch.empty(x.shape[0], raw.shape[0])
    _core._gguf_linear(qtype, out.numpy(), x.numpy(), raw.numpy(), torch.get_num_threads())
    return out if rows.dtype == torch.float32 else out.to(rows.dtype)


class GGUFEmbedding(nn.Module):
    """Token embeddings kept in GGUF blocks; a lookup dequantizes only its rows."""

    def __init__(self, qtype: str, raw: torch.Tensor, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        if qtype not in BLOCK_SIZES or raw.shape[1] != row_bytes(qtype, dim):
            raise ValueError(f"{qtype} rows of {dim} elements do not match {tuple(raw.shape)}")
        self.qtype, self.embedding_dim, self.dtype = qtype, dim, dtype
        self.num_embeddings = raw.shape[0]
        self.raw: torch.Tensor
        self.register_buffer("raw", raw, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize(self.raw[input_ids.reshape(-1)], self.qtype).to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def as_linear(self) -> GGUFLinear:
        """The tied LM head: the same blocks (no copy), as a linear layer."""
        return GGUFLinear([(self.qtype, self.raw)], self.embedding_dim, None)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype}"
