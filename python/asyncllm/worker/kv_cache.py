"""Sizing and allocating the paged KV cache: one preallocated tensor per layer,
`[2, num_blocks, block_size, num_kv_heads, head_dim]` (K then V), in
`EngineConfig.kv_cache_dtype` (the model's dtype unless set apart)."""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError
from asyncllm.worker.huge_pages import advise_huge_pages

_GIB = 1 << 30


def bytes_per_block(config: EngineConfig, model: Any) -> int:
    itemsize = torch.empty((), dtype=config.torch_kv_cache_dtype).element_size()
    return 2 * model.num_layers * config.block_size * model.num_kv_heads * model.head_dim * itemsize


def num_kv_blocks_for(config: EngineConfig, model: Any) -> int:
    """Blocks from `num_kv_blocks`, or from the memory budget. A budget-derived
    count is capped at twice what every seat filled to `max_model_len` could use:
    beyond that, memory only feeds the prefix cache. It must hold one request of
    max_model_len (of its window, when every layer is a sliding-window one)."""
    per_block = bytes_per_block(config, model)
    blocks_per_seq = -(-config.max_model_len // config.block_size)
    windows = getattr(model, "layer_windows", None)
    if windows and None not in windows:
        # Every layer is a sliding-window one: a request holds about its window
        # (the KV-cache manager gives back the rest), so one request needs that.
        needs = min(blocks_per_seq, -(-max(windows) // config.block_size) + 1)
    else:
        needs = blocks_per_seq
    if config.num_kv_blocks is not None:
        num = config.num_kv_blocks
    else:
        if config.kv_cache_memory_gib is not None:
            budget = config.kv_cache_memory_gib * _GIB
        else:  # CUDA without an explicit size: a fraction of what is free now
            free, _ = torch.cuda.mem_get_info(config.torch_device)
            budget = free * config.cuda_kv_fraction
        num = min(int(budget // per_block), 2 * config.max_num_seqs * blocks_per_seq)
    if num < needs:
        raise ConfigError(
            f"the KV cache holds {num} blocks of {config.block_size} tokens, fewer than the "
            f"{needs} one request of max_model_len={config.max_model_len} needs: raise "
            "EngineArgs.num_kv_blocks / kv_cache_memory_gib or lower max_model_len"
        )
    return num


def allocate_kv_caches(config: EngineConfig, model: Any, num_blocks: int) -> list[torch.Tensor]:
    # Zeroed, not empty: padded block-table entries read real memory, and NaN
    # garbage there would survive a zero attention weight (0 * NaN = NaN). On the
    # CPU, huge pages are asked for before the zeros touch the memory: blocks are
    # read in random order (`huge_pages`).
    shape = (2, num_blocks, config.block_size, model.num_kv_heads, model.head_dim)
    caches = []
    for _ in range(model.num_layers):
        cache = torch.empty(shape, dtype=config.torch_kv_cache_dtype, device=config.torch_device)
        advise_huge_pages(cache)
        caches.append(cache.zero_())
    return caches
