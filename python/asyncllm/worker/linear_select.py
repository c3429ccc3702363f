"""Choosing each linear layer's kernel by measuring them when the model loads.

For every distinct (weight shape, dtype, bias) of the model and every row-count
bucket (`models.linear_kernels.BUCKETS`), each available kernel is timed on the
weight itself (the best of 7 rounds that alternate the kernels, after a warm call:
a few ms a shape, and load from elsewhere hits every kernel alike), and the layout
that serves the buckets best is chosen:

    reordered   oneDNN for every bucket
    plain       per bucket the faster of torch's F.linear and the rust kernel

scored by the sum over buckets of (layout's time / best time), so neither a large
nor a small bucket dominates. The choices are cached on disk per CPU model, ISA
flags, torch and extension version, thread count, dtype and shape
(`$XDG_CACHE_HOME/asyncllm/linear-kernels.json`), so a second start measures
nothing. CUDA and tensor-parallel ranks keep `F.linear`.

`linear_kernel` other than "auto" forces one kernel everywhere (tests, checks);
`batch_invariant` forces the rust kernel, whose result for a row does not depend
on the rows around it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import _core
from asyncllm.models.fused_decode import MAX_ROWS as FUSED_MAX_ROWS
from asyncllm.models.linear_kernels import (
    BUCKETS,
    RUST_MAX_ROWS,
    KernelLinear,
    onednn_available,
    pack_onednn,
    run_onednn,
    run_rust,
    rust_supports,
)

logger = logging.getLogger(__name__)

# Part of the cache key: bump it when a kernel's speed changes, so that machines
# measure again rather than keep choices made against the old kernel (3, 4: the GGUF
# integer kernel at 8-16 rows, 2.4x faster; GGUF layers: the integer kernel for
# every bucket up to 16 rows; 5: the integer kernel with weight rows in the lanes, 2-2.6x
# faster at 4-64 rows, measured beyond 16 rows too; 6: GGUF blocks in the panel
# layout, the integer kernel 1.3-1.9x faster at one row, the float ones unpacking).
CACHE_VERSION = 6
REPS = 7
# Where the model's small decode steps run fused (which reads the checkpoint's
# layout), oneDNN's reordered layout must beat it by this factor on the larger
# buckets to be chosen: the fused step is worth more than a small GEMM gain.
ONEDNN_MARGIN = 1.5


def select_linear_kernels(
    model: nn.Module,
    *,
    mode: str,
    batch_invariant: bool,
    num_threads: int,
    prefer_plain: bool = False,
) -> dict[str, tuple[str, ...]]:
    """Replace every plain `nn.Linear` of `model` (and its LM head) by a
    `KernelLinear` on the kernels chosen for its shape; returns shape key ->
    kernels per bucket, for the log and the benchmarks. `prefer_plain`: the
    model's decode steps can run fused (see `_onednn_wins`)."""
    first = next(model.parameters())
    if first.device.type != "cpu" or getattr(model, "tp", None) is not None:
        return {}
    if batch_invariant:
        mode = "rust"
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    cache = DiskCache(num_threads)
    chosen: dict[str, tuple[str, ...]] = {}

    def kernels_for(weight: torch.Tensor, bias: torch.Tensor | None, tied: bool) -> tuple[str, ...]:
        key = f"{weight.dtype}:{tuple(weight.shape)}:{'bias' if bias is not None else '-'}"
        if tied:
            key += ":tied"
        if prefer_plain:
            key += ":plain"
        if key not in chosen:
            if mode != "auto":
                chosen[key] = _forced(mode, weight, tied)
            else:
                found = cache.get(key)
                if found is None:
                    found = _measure(weight, bias, tied, num_threads, prefer_plain)
                    cache.put(key, found)
                chosen[key] = found
        return chosen[key]

    for parent, name, linear in targets:
        kernels = kernels_for(linear.weight, linear.bias, tied=False)
        setattr(parent, name, KernelLinear(linear.weight, linear.bias, kernels, num_threads))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", None) is None and isinstance(embed, nn.Embedding):
        kernels = kernels_for(embed.weight, None, tied=True)
        model.logits_head = KernelLinear(embed.weight, None, kernels, num_threads)
    elif isinstance(getattr(model, "lm_head", None), KernelLinear):
        model.logits_head = model.lm_head
    cache.save()
    logger.info(
        "linear kernels (%s, %d threads): %s",
        "batch-invariant" if batch_invariant else mode,
        num_threads,
        "; ".join(f"{k} -> {describe_kernels(v)}" for k, v in chosen.items()),
    )
    return chosen


def describe_kernels(kernels: tuple[str, ...]) -> str:
    """Runs of buckets that share a kernel, as "1-8:rust,16-:onednn"."""
    runs: list[str] = []
    start = 0
    for i in range(1, len(kernels) + 1):
        if i == len(kernels) or kernels[i] != kernels[start]:
            hi = "" if i == len(kernels) else str(BUCKETS[i - 1])
            runs.append(f"{BUCKETS[start] if start else 1}-{hi}:{kernels[start]}")
            start = i
    return ",".join(runs)


def _forced(mode: str, weight: torch.Tensor, tied: bool) -> tuple[str, ...]:
    if mode == "onednn" and (tied or not onednn_available(weight.dtype)):
        mode = "torch"  # a tied head keeps the embedding's layout
    if mode == "rust" and not rust_supports(weight):
        mode = "torch"
    return (mode,) * len(BUCKETS)


def best_times(fns: dict[str, Callable[[], Any]]) -> dict[str, float]:
    """Each candidate's best time over `REPS` rounds, the candidates alternating
    within a round so that load from elsewhere hits them alike (the best time is
    the one least disturbed: what the kernel does on this machine)."""
    for fn in fns.values():
        fn()  # warm: first-call allocations, oneDNN's primitive cache
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(REPS):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _measure(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    tied: bool,
    num_threads: int,
    prefer_plain: bool = False,
) -> tuple[str, ...]:
    """The kernels per bucket for this weight, by timing each on it."""
    w = weight.detach()
    packed = pack_onednn(w) if onednn_available(w.dtype) and not tied else None
    rust_ok = rust_supports(w)
    plain: list[tuple[str, float]] = []
    onednn: list[float] = []
    best: list[float] = []
    # a generator of its own: measuring leaves torch's global random state (which
    # the runner seeded) as it was
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for rows in BUCKETS:
            x = torch.randn(rows, w.shape[1], generator=gen).to(w.dtype)
            fns: dict[str, Callable[[], Any]] = {"torch": partial(F.linear, x, w, bias)}
            if packed is not None:
                fns["onednn"] = partial(run_onednn, x, packed, bias)
            if rust_ok and rows <= RUST_MAX_ROWS:
                fns["rust"] = partial(run_rust, x, w, bias, num_threads)
            t = best_times(fns)
            best.append(min(t.values()))
            plain.append(
                min(((k, t[k]) for k in ("torch", "rust") if k in t), key=lambda kt: kt[1])
            )
            if packed is not None:
                onednn.append(t["onednn"])
    if onednn and _onednn_wins(plain, onednn, best, prefer_plain):
        return ("onednn",) * len(BUCKETS)
    return tuple(k for k, _ in plain)


def _onednn_wins(
    plain: list[tuple[str, float]], onednn: list[float], best: list[float], prefer_plain: bool
) -> bool:
    """Whether the reordered layout serves the buckets better than the checkpoint's.
    With `prefer_plain` (the model's small decode steps can run fused, which needs
    the checkpoint's layout: asyncllm.models.fused_decode) only when oneDNN is
    faster by more than ONEDNN_MARGIN over the buckets the fused path leaves to the
    layers; else by the sum over buckets of (time / best time)."""
    if prefer_plain:
        large = [i for i, rows in enumerate(BUCKETS) if rows > FUSED_MAX_ROWS]
        plain_large = sum(plain[i][1] for i in large)
        return plain_large > ONEDNN_MARGIN * sum(onednn[i] for i in large)
    plain_score = sum(t / b for (_, t), b in zip(plain, best, strict=True))
    return sum(t / b for t, b in zip(onednn, best, strict=True)) < plain_score


def _cpu_key(num_threads: int) -> str:
    """What the measurements depend on: the CPU (model name and flags), the
    software (torch, the extension) and the thread count."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = f.read().splitlines()
        model = next((ln for ln in lines if ln.startswith("model name")), "")
        flags = next((ln for ln in lines if ln.startswith("flags")), "")
        cpu = f"{model}|{flags}"
    except OSError:
        pass
    raw = f"{cpu}|{torch.__version__}|{_core.native_version()}|{num_threads}|{CACHE_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:24]


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncllm" / "linear-kernels.json"


class DiskCache:
    """The choices of earlier starts on this machine: {cpu key: {shape key: kernels}}."""

    def __init__(self, num_threads: int) -> None:
        self.key = _cpu_key(num_threads)
        self.path = cache_path()
        self.dirty = False
        try:
            data = json.loads(self.path.read_text())
            self.entries: dict[str, list[str]] = dict(data.get(self.key, {}))
            self.all: dict[str, Any] = data if isinstance(data, dict) else {}
        except (OSError, ValueError, AttributeError, TypeError):
            self.entries, self.all = {}, {}

    def get(self, key: str) -> tuple[str, ...] | None:
        found = self.entries.get(key)
        if isinstance(found, list) and len(found) == len(BUCKETS):
            return tuple(str(k) for k in found)
        return None

    def put(self, key: str, kernels: tuple[str, ...]) -> None:
        self.entries[key] = list(kernels)
        self.dirty = True

    def save(self) -> None:
        """Written beside and renamed: a concurrent start reads a whole file or none."""
        if not self.dirty:
            return
        self.all[self.key] = self.entries
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".linear-kernels-")
            with os.fdopen(fd, "w") as f:
                json.dump(self.all, f)
            os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: measure again next time
            logger.warning("cannot cache the linear kernel choices in %s: %s", self.path, e)
