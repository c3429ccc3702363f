"""The CPU decode-attention kernel (csrc/paged_decode.c), compiled on first use.

Plain torch has no way to read K/V through block tables without first copying them
out (a gather that costs as much as the attention itself); this small C kernel reads
the paged cache in place. It is compiled per process (well under a second) with the
machine's C compiler against the OpenMP runtime torch has already loaded, so nothing
is cached across machines. Without a compiler the torch path is used and a warning
says so once.
"""

from __future__ import annotations

import ctypes
import logging
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


@cache
def _library() -> ctypes.CDLL | None:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: paged decode attention uses the slower torch path")
        return None
    target = Path(tempfile.mkdtemp(prefix="asyncllm-")) / "paged_decode.so"
    cmd = [
        compiler,
        "-O3",
        "-march=native",
        "-ffast-math",
        "-fopenmp",
        "-shared",
        "-fPIC",
        str(SOURCE),
        "-o",
        str(target),
        "-lm",
    ]
    try:
        subprocess.run(cmd, check=True, capture_output=True, timeout=120)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        logger.warning(
            "building %s failed (%s): paged decode attention uses the torch path", SOURCE.name, e
        )
        return None
    fn = lib.paged_decode_f32
    fn.argtypes = [
        _ptr,
        _ptr,
        _ptr,
        _i64,
        _ptr,
        _i64,
        _ptr,
        _ptr,
        _i64,
        _i64,
        _i64,
        _i64,
        _i64,
        ctypes.c_float,
        ctypes.c_int,
    ]
    fn.restype = None
    return lib


def can_use_kernel(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether `paged_decode` serves these tensors (CPU, float32, contiguous cache)."""
    return (
        q.device.type == "cpu"
        and q.dtype == torch.float32
        and kv_cache.dtype == torch.float32
        and kv_cache.is_contiguous()
        and _library() is not None
    )


def paged_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention of q [B, Hq, D] over each row's seq_lens[b] cached keys, read
    through `tables` [B, nb] int64; returns [B, Hq * D]. Check `can_use_kernel` first."""
    lib = _library()
    assert lib is not None
    q = q.contiguous()
    batch, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype)
    lib.paged_decode_f32(
        q.data_ptr(),
        kv_cache[0].data_ptr(),
        kv_cache[1].data_ptr(),
        num_kv_heads * head_dim,
        tables.data_ptr(),
        tables.stride(0),
        seq_lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        scale,
        torch.get_num_threads(),
    )
    return out
