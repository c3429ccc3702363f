"""Fused layers through torch.compile (`EngineArgs.compile`, `--compile`).

What is compiled: the elementwise work between a layer's matmuls, the functions of
`asyncllm.models.layers.FusedOps` (RMSNorm, the residual add with the next norm,
rotary on q and k, SiLU x up), each into one inductor kernel that passes over its
inputs once. The matmuls and the paged attention stay eager: inductor's CPU backend
calls the same GEMMs, and the attention kernel is ours. Models whose layers do not
use `FusedOps` (Gemma's norms and GeGLU) keep those parts eager.

Small steps (fewer than `MIN_TOKENS` tokens: low-load decodes) run the eager ops,
where a compiled call's fixed cost outweighs the fused pass.

Shapes: the token dimension is dynamic. `compile_model` runs one forward with dim 0 of
every compiled op's inputs marked dynamic and with size-oblivious guards, so the
graphs it compiles serve every step's token count, 1 included: no recompile across
batch sizes (tests/test_compile.py counts them).

Cache: inductor's FX-graph and AOT caches live under `inductor_cache_dir()`, so a
second start reloads the kernels instead of compiling them (README gives the cold
and warm start-up times).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
from torch import nn

from asyncllm.models.attention import build_attention_metadata
from asyncllm.models.layers import (
    FusedOps,
    add_rms_norm,
    apply_rotary,
    rms_norm,
    set_ops,
    silu_mul,
)

logger = logging.getLogger(__name__)

_WARM_UP_TOKENS = 3  # > 1: the token dim must not be traced as the constant 1
# Steps with fewer tokens run the eager ops: a compiled call costs ~50-100 us more
# in dynamo's guards and wrappers than an eager one, which a fused pass over a few
# rows does not win back (measured on small's shapes: the fused ops pull ahead
# from ~128-256 tokens; README).
MIN_TOKENS = 128
_compiled: FusedOps | None = None
_by_size: FusedOps | None = None


def inductor_cache_dir() -> Path:
    """Where compiled kernels persist across runs: $TORCHINDUCTOR_CACHE_DIR when set,
    else $XDG_CACHE_HOME/asyncllm/inductor (~/.cache/asyncllm/inductor)."""
    explicit = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncllm" / "inductor"


def compiled_ops() -> FusedOps:
    """The process's torch.compile'd `FusedOps` (built once; dynamo caches the
    graphs per function, so every model in the process shares them)."""
    global _compiled
    if _compiled is None:
        path = inductor_cache_dir()
        path.mkdir(parents=True, exist_ok=True)
        # read by inductor when it first looks for its cache: before any compile
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)

        def compile_fn(fn: Any) -> Any:
            return torch.compile(fn, backend="inductor", fullgraph=True)

        _compiled = FusedOps(
            rms_norm=compile_fn(rms_norm),
            add_rms_norm=compile_fn(add_rms_norm),
            silu_mul=compile_fn(silu_mul),
            rotary=compile_fn(apply_rotary),
        )
    return _compiled


def size_dispatched_ops() -> FusedOps:
    """The ops a compiled model's layers call: compiled from `MIN_TOKENS` tokens
    on, eager below (every op's first argument has the step's tokens as dim 0)."""
    global _by_size
    if _by_size is None:
        compiled = compiled_ops()

        def pick(eager: Any, fused: Any) -> Any:
            def op(x: torch.Tensor, *rest: Any) -> Any:
                return (fused if x.shape[0] >= MIN_TOKENS else eager)(x, *rest)

            return op

        _by_size = FusedOps(
            rms_norm=pick(rms_norm, compiled.rms_norm),
            add_rms_norm=pick(add_rms_norm, compiled.add_rms_norm),
            silu_mul=pick(silu_mul, compiled.silu_mul),
            rotary=pick(apply_rotary, compiled.rotary),
        )
    return _by_size


def _marking(ops: FusedOps) -> FusedOps:
    """`ops` with dim 0 (tokens) of every multi-dim tensor input marked dynamic, for
    the warm-up forward that compiles the graphs (weights stay static)."""

    def wrap(fn: Any) -> Any:
        def marked(*args: Any) -> Any:
            for a in args:
                if isinstance(a, torch.Tensor) and a.dim() > 1:
                    torch._dynamo.mark_dynamic(a, 0)
            return fn(*args)

        return marked

    return FusedOps(
        rms_norm=wrap(ops.rms_norm),
        add_rms_norm=wrap(ops.add_rms_norm),
        silu_mul=wrap(ops.silu_mul),
        rotary=wrap(ops.rotary),
    )


@torch.inference_mode()
def compile_model(model: nn.Module, kv_caches: list[torch.Tensor], block_size: int) -> None:
    """Swap the model's elementwise ops for compiled ones and compile them now, with
    one warm-up forward of a short fresh prompt written into the first KV blocks
    (zeroed again after), so that no request pays the compile."""
    start = time.perf_counter()
    ops = compiled_ops()
    if set_ops(model, _marking(ops)) == 0:
        logger.info("compile: %s has no fused layers; it runs eager", type(model).__name__)
        return
    device = kv_caches[0].device
    n = _WARM_UP_TOKENS
    blocks = -(-n // block_size)
    meta = build_attention_metadata(
        np.array([n]), np.array([0]), np.arange(blocks)[None], np.arange(n), block_size, device
    )
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    try:
        # size-oblivious guards: the graphs traced here do not special-case 1 token
        with fx_config.patch(backed_size_oblivious=True):  # type: ignore[attr-defined]
            model(ids, positions, kv_caches, meta)
    finally:
        set_ops(model, size_dispatched_ops())
        for cache in kv_caches:
            cache[:, :blocks].zero_()
    logger.info(
        "compile: fused layers ready in %.1f s (kernel cache %s)",
        time.perf_counter() - start,
        inductor_cache_dir(),
    )
