"""Choosing each GGUF linear layer's kernel per bucket of rows by timing them on
the layer when the model loads, as `linear_select` does for float weights (the same
timing and the same disk cache, under keys of their own).

Why measure: which is faster at which row count — the integer matrix-vector kernel,
float32 tiles and torch's GEMM, or bf16 tiles on the CPU's bf16 GEMM (AMX where it
has one) — depends on the CPU and the shape; at one row the integer kernel reads a
quarter of bf16's bytes, at 64 rows a bf16 GEMM may win despite dequantizing.
`ASYNCLLM_GGUF_KERNEL` forces one kernel everywhere (checks, benchmarks); the
batch-invariant mode forces `int`, whose result for a row does not depend on the
rows beside it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from asyncllm import envs
from asyncllm.models.gguf.layers import FUSED_MAX_ROWS, GGUF_KERNELS, INT_TYPES, GGUFLinear
from asyncllm.models.linear_kernels import BUCKETS
from asyncllm.worker.linear_select import DiskCache, best_times, describe_kernels

logger = logging.getLogger(__name__)


def select_gguf_kernels(
    model: nn.Module, *, batch_invariant: bool, num_threads: int, dtype: torch.dtype
) -> dict[str, tuple[str, ...]]:
    """Set the kernels of every `GGUFLinear` of `model` (the LM head included);
    returns shape key -> kernel per bucket, for the log and the benchmarks. Raises
    ValueError on a bad ASYNCLLM_GGUF_KERNEL."""
    forced = "int" if batch_invariant else envs.gguf_kernel()
    if forced != "auto" and forced not in GGUF_KERNELS:
        raise ValueError(f"ASYNCLLM_GGUF_KERNEL must be 'auto' or one of {GGUF_KERNELS}")
    layers = [m for m in model.modules() if isinstance(m, GGUFLinear)]
    if not layers or layers[0].part0.device.type != "cpu":
        return {}
    cache = DiskCache(num_threads)
    chosen: dict[str, tuple[str, ...]] = {}
    for layer in layers:
        key = f"gguf:{'+'.join(layer.qtypes)}:{layer.out_features}x{layer.in_features}:{dtype}"
        if key not in chosen:
            if forced != "auto":
                chosen[key] = (forced,) * len(BUCKETS)
            else:
                found = cache.get(key)
                if found is None or not set(found) <= set(GGUF_KERNELS):
                    found = measure(layer, dtype)
                    cache.put(key, found)
                chosen[key] = found
        layer.set_kernels(chosen[key])
    cache.save()
    logger.info(
        "GGUF kernels (%d threads): %s",
        num_threads,
        "; ".join(f"{k} -> {describe_kernels(v)}" for k, v in chosen.items()),
    )
    return chosen


def measure(layer: GGUFLinear, dtype: torch.dtype) -> tuple[str, ...]:
    """Up to FUSED_MAX_ROWS rows the integer kernel (the float one for a layer of
    float parts only), unmeasured; beyond, the fastest of the integer kernel and
    the tiled ones (ties to the earlier of GGUF_KERNELS: the integer kernel, whose
    bits for a row do not depend on the step's other rows). With weight rows in
    the lanes the integer kernel runs 64 rows at 3-4 G block-dots/s a thread, so a
    prefill of a few short prompts keeps the bits of the decode steps.

    Why one kernel for every small bucket: a request's bits then do not change as
    other streams come and go, and a speculative verification gives its decode
    steps' tokens even when fewer requests are live than in the run without it
    (issue 29; with tiles chosen at 9-16 rows, SmolLM2 kept 95 % of its greedy
    tokens under speculation). After the grouping and offset fixes the integer
    kernel is at or near the tiled ones' speed at 16 rows anyway."""
    has_int = any(q in INT_TYPES for q in layer.qtypes)
    small = "int" if has_int else "float"
    gen = torch.Generator().manual_seed(0)  # leaves torch's global random state alone
    kernels = []
    with torch.inference_mode():
        for rows in BUCKETS:
            if rows <= FUSED_MAX_ROWS:
                kernels.append(small)
                continue
            x = torch.randn(rows, layer.in_features, generator=gen).to(dtype)
            names = [k for k in GGUF_KERNELS if k.startswith("tiles") or (k == "int" and has_int)]
            fns: dict[str, Callable[[], Any]] = {k: partial(layer.run, k, x) for k in names}
            times = best_times(fns)
            kernels.append(min(names, key=lambda k: times[k]))
    return tuple(kernels)
