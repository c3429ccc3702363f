"""The paged KV cache on huge pages: its blocks are read in random order, so on the
CPU the engine asks Linux for 2 MiB pages (`worker/huge_pages.py`) before the cache
is zeroed. What the advice leaves behind is the mapping's `hg` flag in
/proc/self/smaps, whatever pages the kernel then finds."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.worker.huge_pages import HUGE_PAGE, advise_huge_pages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists(),
    reason="transparent huge pages: a Linux feature this kernel lacks",
)


def _vm_flags(addr: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `addr`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


def _first_huge_page(t: torch.Tensor) -> int:
    return -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE


def test_a_large_tensor_is_advised_and_a_small_one_left_alone() -> None:
    big = torch.empty(8 << 20, dtype=torch.uint8)
    advised = advise_huge_pages(big)
    # the whole 2 MiB pages inside it: 3 or 4 of them, by its alignment
    assert 3 * HUGE_PAGE <= advised <= 4 * HUGE_PAGE
    assert "hg" in _vm_flags(_first_huge_page(big))
    assert advise_huge_pages(torch.empty(1000)) == 0


def test_the_engines_kv_cache_is_advised_and_zero() -> None:
    llm = LLM(multiprocess=False, dtype="float32", num_kv_blocks=2048)
    caches = llm.engine.core.runner.kv_caches
    for cache in caches:
        assert cache.numel() * cache.element_size() >= 2 * HUGE_PAGE
        assert "hg" in _vm_flags(_first_huge_page(cache))
    # zero before any request (padded table entries read it)
    assert all(not cache.any() for cache in caches)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
