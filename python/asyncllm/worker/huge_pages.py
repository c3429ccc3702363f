"""Transparent huge pages for the large tensors the CPU reads at random: the paged KV
cache. Its blocks are read in table order, which is random, so with 4 KiB pages nearly
every block's read starts with a TLB miss and a page walk. Linux backs a range with
2 MiB pages where `madvise(MADV_HUGEPAGE)` asks for them. That is needed where
`/sys/kernel/mm/transparent_hugepage/enabled` is "madvise" (Debian's and many
distributions' default), and harmless where it is "always" or "never". The advice
must come before the pages are first touched.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable

import torch

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def _madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None
    fn = libc.madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_MADVISE = _madvise()


def advise_huge_pages(t: torch.Tensor) -> int:
    """Asks Linux to back the whole 2 MiB pages inside `t`'s memory with huge pages;
    returns the bytes advised (0 off Linux, off the CPU, or below one huge page).
    Call it before `t` is written. A refusal (`EINVAL` where the kernel has no THP)
    is not an error: the memory stays as it is."""
    if _MADVISE is None or t.device.type != "cpu":
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // HUGE_PAGE) * HUGE_PAGE, end // HUGE_PAGE * HUGE_PAGE
    if hi <= lo:
        return 0
    if _MADVISE(lo, hi - lo, MADV_HUGEPAGE) != 0:
        return 0
    return hi - lo
