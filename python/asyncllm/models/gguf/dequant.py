"""GGUF block formats dequantized: the extension's kernel on the CPU
(rust/kernels/gguf.rs, about 100x the torch code below), torch elsewhere.

Both compute each element with gguf-py's operations in gguf-py's order. In torch,
each function takes the raw blocks of one type as uint8 [n_blocks, type_size] and
returns float32 [n_blocks, block_size], computed with the same operations in the
same order as gguf-py's numpy `dequantize_blocks`, so the results are equal bit for
bit (tests/test_gguf_dequant.py; NaN where it has NaN, whose payload bits the CPU's
conversions may set otherwise). `dequantize` applies one to the rows of a weight.
Faster kernels are checked against this one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncllm import _core
from asyncllm.errors import ModelLoadError

QK_K = 256
# type name -> (elements per block, bytes per block), as ggml defines them
BLOCK_SIZES: dict[str, tuple[int, int]] = {
    "F32": (1, 4),
    "F16": (1, 2),
    "BF16": (1, 2),
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (QK_K, 144),
    "Q5_K": (QK_K, 176),
    "Q6_K": (QK_K, 210),
}


def _f16(raw: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of every block, as float32 [n, 1]."""
    return raw[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """Bytes [n, groups * w] -> [n, groups, 2 * w]: per group of w bytes, the low
    nibbles then the high ones (ggml's layout)."""
    n = qs.shape[0]
    q = qs.reshape(n, groups, -1)
    return torch.stack((q & 0x0F, q >> 4), dim=2).reshape(n, groups, -1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """Four bytes per block as a little-endian uint32, its 32 bits as [n, 32] uint8."""
    word = qh.to(torch.int64)
    word = word[:, 0] | word[:, 1] << 8 | word[:, 2] << 16 | word[:, 3] << 24
    shifts = torch.arange(32, dtype=torch.int64)
    return ((word[:, None] >> shifts) & 1).to(torch.uint8)


def _q4_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    qs = _nibbles(raw[:, 2:], 1).reshape(raw.shape[0], -1).to(torch.int8) - 8
    return d * qs.float()


def _q4_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw, 0), _f16(raw, 2)
    qs = _nibbles(raw[:, 4:], 1).reshape(raw.shape[0], -1).float()
    return d * qs + m


def _q5_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    qh = _bits32(raw[:, 2:6])
    ql = _nibbles(raw[:, 6:], 1).reshape(raw.shape[0], -1)
    qs = (ql | (qh << 4)).to(torch.int8) - 16
    return d * qs.float()


def _q5_1(raw: torch.Tensor) -> torch.Tensor:
    d, m = _f16(raw, 0), _f16(raw, 2)
    qh = _bits32(raw[:, 4:8])
    ql = _nibbles(raw[:, 8:], 1).reshape(raw.shape[0], -1)
    return d * (ql | (qh << 4)).float() + m


def _q8_0(raw: torch.Tensor) -> torch.Tensor:
    d = _f16(raw, 0)
    x = raw[:, 2:].contiguous().view(torch.int8).float()
    return x * d


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins packed in a K-block's 12 bytes."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _scale_min_k4(raw[:, 4:16])
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    qs = _nibbles(raw[:, 16:], 4).reshape(n, 8, 32).float()
    return (d * qs - dm).reshape(n, QK_K)


def _q5_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    d, dmin = _f16(raw, 0), _f16(raw, 2)
    sc, mn = _scale_min_k4(raw[:, 4:16])
    d = (d * sc.float()).reshape(n, -1, 1)
    dm = (dmin * mn.float()).reshape(n, -1, 1)
    qh = raw[:, 16:48].reshape(n, 1, 1, 32) >> torch.arange(8, dtype=torch.uint8).reshape(8, 1)
    qh = (qh & 0x01).reshape(n, 8, 32)
    ql = _nibbles(raw[:, 48:], 4).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, QK_K)


def _q6_k(raw: torch.Tensor) -> torch.Tensor:
    n = raw.shape[0]
    scales = raw[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(raw, 208) * scales).reshape(n, QK_K // 16, 1)
    ql = _nibbles(raw[:, :128], 2).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(4, 1)
    qh = ((raw[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, QK_K // 16, -1).float()).reshape(n, QK_K)


def _f32(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float32)


def _f16_all(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).float()


def _bf16(raw: torch.Tensor) -> torch.Tensor:
    return (raw.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)


_BLOCKS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "F32": _f32,
    "F16": _f16_all,
    "BF16": _bf16,
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}


def check_type(qtype: str, what: str) -> None:
    """ModelLoadError naming `what` when `qtype` is not a type we dequantize."""
    if qtype not in _BLOCKS:
        raise ModelLoadError(
            f"GGUF tensor {what}: type {qtype} is not supported; supported: " + ", ".join(_BLOCKS)
        )


def row_bytes(qtype: str, cols: int) -> int:
    """Bytes of one row of `cols` elements (a whole number of blocks)."""
    block, size = BLOCK_SIZES[qtype]
    if cols % block:
        raise ModelLoadError(f"a {qtype} row of {cols} elements is not whole blocks of {block}")
    return cols // block * size


def dequantize(raw: torch.Tensor, qtype: str, panels: bool = False) -> torch.Tensor:
    """Rows of raw blocks uint8 [rows, row_bytes] -> float32 [rows, cols]; `panels`:
    the blocks are in the integer kernel's panel layout (CPU only)."""
    if raw.device.type != "cpu":
        if panels:
            raise ValueError("the panel layout exists on the CPU only")
        return dequantize_torch(raw, qtype)
    block, size = BLOCK_SIZES[qtype]
    raw = raw.contiguous()
    out = torch.empty(raw.shape[0], raw.shape[1] // size * block)
    _core._gguf_dequantize(qtype, raw.numpy(), out.numpy(), panels)
    return out


def dequantize_torch(raw: torch.Tensor, qtype: str) -> torch.Tensor:
    """`dequantize` with torch ops, on any device."""
    block, size = BLOCK_SIZES[qtype]
    rows = raw.shape[0]
    out = _BLOCKS[qtype](raw.reshape(-1, size))
    return out.reshape(rows, -1)
