"""Layers whose weights stay in GGUF blocks in memory.

`GGUFLinear` computes `y = x Wᵀ + b` with one of these kernels, all reading the
blocks, chosen per bucket of rows (`linear_kernels.BUCKETS`; measured at load by
`asyncllm.worker.gguf_select`, else `default_kernels`):

    int     (decode, on the CPU) the extension's `_gguf_linear_int`: x rounded to
            int8 per 16 elements, integer dot products with the blocks; the weight is
            read once per step, as blocks (F32/F16/BF16 parts run `float`)
    float   the extension's `_gguf_linear`: each weight row decoded into a
            cache-resident buffer and dotted with every row of x in float32 (the
            reference of the fast paths: float rounding of dequantize + fp32)
    tiles   a tile of W's rows at a time dequantized (float32, then x's dtype) and
            torch's GEMM on it, so the whole float weight never exists at once
    tiles_bf16  the same with the tile and x in bfloat16 (the CPU's bf16 GEMM,
            AMX where it has it), the output back in x's dtype

`int` differs from dequantize + fp32 by the int8 rounding of x (at most
|w| · max|x_group| / 254 a term); the others by float rounding (bf16: of x and W).

`GGUFEmbedding` gathers the rows of the tokens it is asked for and dequantizes
only those. A tied LM head is a `GGUFLinear` over the embedding's very blocks.

On the CPU the loader repacks the block types' bytes in place into the panel
layout the integer kernel reads with plain vector loads (rust/kernels/
gguf_panels.rs: 1.3-1.9x at one row, the same bits); the float kernel and the
tiles unpack a panel at a time, the embedding's lookups their rows (`unpack_rows`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import _core
from asyncllm.models import kernel_rows
from asyncllm.models.gguf.dequant import BLOCK_SIZES, dequantize, row_bytes
from asyncllm.models.linear_kernels import BUCKETS

# Elements of W dequantized per tile: 4M float32 (16 MiB, transient), so a layer
# of a small model is one tile and one GEMM. Smaller tiles (1 MiB, cache-resident)
# measured 2.5x slower over SmolLM2's linears at 64 rows (Xeon VM, loaded): each
# GEMM call costs a fixed price in thread wake-ups that many small ones multiply.
TILE_ELEMENTS = 1 << 22
GGUF_KERNELS = ("int", "float", "tiles", "tiles_bf16")
# The block types the integer kernel reads.
INT_TYPES = frozenset(BLOCK_SIZES) - {"F32", "F16", "BF16"}
# Up to this many rows the layers run the integer kernel (a dot product per weight
# row and x row, the same bits for a row whatever rows share the step:
# worker/gguf_select.py), and the fused decode step takes GGUF steps.
FUSED_MAX_ROWS = 16
# Without a measurement: int up to this many rows, then tiles.
DEFAULT_INT_ROWS = 8


def default_kernels() -> tuple[str, ...]:
    """The kernel per bucket when none was measured (tests, other devices)."""
    return tuple("int" if rows <= DEFAULT_INT_ROWS else "tiles" for rows in BUCKETS)


def unpack_rows(raw: torch.Tensor, qtype: str, ids: list[int] | None = None) -> torch.Tensor:
    """Rows `ids` (all by default) of blocks in the panel layout, in the GGUF layout
    (a new tensor). A slice of rows from a multiple of 16 to one, or to the end,
    is itself in the panel layout."""
    ids = list(range(raw.shape[0])) if ids is None else ids
    out = torch.empty(len(ids), raw.shape[1], dtype=torch.uint8)
    _core._gguf_unpack_rows(qtype, raw.numpy(), ids, out.numpy())
    return out


def bucket_index(rows: int) -> int:
    """The bucket a step of `rows` rows takes: the first >= rows, else the last."""
    return next((i for i, b in enumerate(BUCKETS) if rows <= b), len(BUCKETS) - 1)


class GGUFLinear(nn.Module):
    """A linear layer over one or more row blocks of GGUF weights (a fused q/k/v
    whose parts have different types keeps one part per type)."""

    def __init__(
        self,
        parts: list[tuple[str, torch.Tensor]],
        in_features: int,
        bias: torch.Tensor | None,
        panels: bool = False,
    ) -> None:
        """`panels`: the block parts are already in the panel layout (a tied head
        over a repacked embedding)."""
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
        # whole panels of 16 rows, so that every tile of a repacked part is
        # itself in the panel layout
        self.tile_rows = max(16, TILE_ELEMENTS // in_features // 16 * 16)
        self.kernels = default_kernels()
        # per part: whether its blocks are in the panel layout
        self.panels = tuple(panels and q in INT_TYPES for q in self.qtypes)
        # the output's dtype, None: the input's. An LM head's is float32 (the
        # loader sets it): its kernels compute in float32 and the sampler reads
        # float32, so rounding [rows, vocab] to bf16 between them cost two
        # conversions into fresh memory (144 rows of SmolLM2: ~50 ms a step,
        # 4x the kernel) and the logits' precision
        self.out_dtype: torch.dtype | None = None

    def pack_panels(self) -> None:
        """Repack the block parts on the CPU into the panel layout, in place (once;
        the buffers' other holders, a tied embedding, must know)."""
        flags = []
        for (qtype, raw), packed in zip(self.parts(), self.panels, strict=True):
            if not packed and qtype in INT_TYPES and raw.device.type == "cpu":
                _core._gguf_pack_panels(qtype, raw.numpy())
                packed = True
            flags.append(packed)
        self.panels = tuple(flags)

    def set_kernels(self, kernels: tuple[str, ...]) -> None:
        """One kernel of GGUF_KERNELS per bucket of BUCKETS."""
        if len(kernels) != len(BUCKETS) or not set(kernels) <= set(GGUF_KERNELS):
            raise ValueError(f"kernels must name one of {GGUF_KERNELS} per bucket {BUCKETS}")
        self.kernels = tuple(kernels)

    def parts(self) -> list[tuple[str, torch.Tensor]]:
        return [(q, getattr(self, f"part{i}")) for i, q in enumerate(self.qtypes)]

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole float weight [out, in] (tests, and a bf16 copy for benchmarks)."""
        parts = zip(self.parts(), self.panels, strict=True)
        return torch.cat([dequantize(raw, q, p) for (q, raw), p in parts]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        on_cpu = rows.device.type == "cpu"
        n = kernel_rows.rows or rows.shape[0]
        out = self.run(self.kernels[bucket_index(n)] if on_cpu else "tiles", rows)
        return out.view(*x.shape[:-1], self.out_features)

    def run(self, kernel: str, rows: torch.Tensor) -> torch.Tensor:
        """x · Wᵀ + b for `rows` [m, in] by `kernel` (one of GGUF_KERNELS; int and
        float on the CPU only)."""
        outs = []
        for (qtype, raw), panels in zip(self.parts(), self.panels, strict=True):
            if kernel in ("int", "float"):
                fn = _core._gguf_linear_int if kernel == "int" and qtype in INT_TYPES else None
                outs.append(_fused(fn or _core._gguf_linear, qtype, rows, raw, panels))
                continue
            dtype = torch.bfloat16 if kernel == "tiles_bf16" else rows.dtype
            x = rows if rows.dtype == dtype else rows.to(dtype)
            for start in range(0, raw.shape[0], self.tile_rows):
                w = dequantize(raw[start : start + self.tile_rows], qtype, panels)
                outs.append(F.linear(x, w if x.dtype == w.dtype else w.to(dtype)))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        dtype = self.out_dtype or rows.dtype
        if out.dtype != dtype:
            out = out.to(dtype)
        if self.bias is not None:
            out = out + self.bias
        return out

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, types={self.qtypes}"


def _fused(
    fn: Callable[..., None],
    qtype: str,
    rows: torch.Tensor,
    raw: torch.Tensor,
    panels: bool = False,
) -> torch.Tensor:
    """x · Wᵀ in float32 by one of the extension's kernels on the blocks, in the
    panel layout when `panels` (the caller rounds it to its output dtype)."""
    x = rows.float().contiguous()
    out = torch.empty(x.shape[0], raw.shape[0])
    fn(qtype, out.numpy(), x.numpy(), raw.numpy(), torch.get_num_threads(), panels=panels)
    return out


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
        self.panels = False

    def pack_panels(self) -> None:
        """Repack the blocks into the panel layout in place (a tied head's kernel
        reads them every step; a lookup reads its few rows back), on the CPU."""
        if not self.panels and self.qtype in INT_TYPES and self.raw.device.type == "cpu":
            _core._gguf_pack_panels(self.qtype, self.raw.numpy())
            self.panels = True

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.reshape(-1)
        raw = unpack_rows(self.raw, self.qtype, ids.tolist()) if self.panels else self.raw[ids]
        rows = dequantize(raw, self.qtype).to(self.dtype)
        return rows.view(*input_ids.shape, self.embedding_dim)

    def as_linear(self) -> GGUFLinear:
        """The tied LM head: the same blocks (no copy), as a linear layer."""
        return GGUFLinear([(self.qtype, self.raw)], self.embedding_dim, None, self.panels)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype}"
