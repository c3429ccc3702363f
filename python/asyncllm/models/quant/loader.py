"""Putting `QuantLinear` layers into a model: from a compressed-tensors checkpoint
(before the float tensors are read), or by quantizing a float model's linear layers
at load (`EngineArgs.quantization`, vLLM's `--quantization`).

Either way every replaced `nn.Linear` is swapped for a QuantLinear in place, so the
model files do not change; the kernel selection at load (`worker.linear_select`)
and the fused decode kernel leave QuantLinear alone (they take plain `nn.Linear`).
A quantized LM head becomes `model.logits_head`.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ModelLoadError
from asyncllm.models.parallel_layers import RowParallelLinear, weight_shards
from asyncllm.models.quant.compressed import Reader, load_compressed_linear, scheme_of
from asyncllm.models.quant.layers import QuantLinear, RowParallelQuantLinear, pack_int4

# --quantization methods: (bits of the weight integers, inputs per scale group).
# Weights are quantized round to nearest, symmetric, one f16 scale per group of
# inputs of each output row; activations stay in the model's dtype (W8A16, W4A16).
# int4 takes groups of 32 (GGUF's Q4_0 block): with 128, asyncllm-tiny's next-token
# logprobs moved 0.68 at worst from the float model's, with 32 0.34.
METHODS = {"int8": (8, 128), "int4": (4, 32)}


def replace_compressed_linears(
    model: nn.Module,
    qc: dict[str, Any],
    sources: dict[str, list[str]],
    read: Reader,
    has: Callable[[str], bool],
) -> None:
    """Swap every Linear that the checkpoint stores quantized for a QuantLinear read
    from it; its bias (if any) is left for the float loader to fill. Under tensor
    parallelism a rank keeps its slices (`weight_shards`), row-parallel layers
    all-reducing their partial products."""
    tp = getattr(model, "tp", None)
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear):
            continue
        srcs = sources[f"{path}.weight"]
        names = [src.removesuffix(".weight") for src in srcs]
        schemes = [scheme_of(qc, name) for name in names]
        if all(s is None for s in schemes):
            continue
        if any(s is None for s in schemes):
            raise ModelLoadError(
                f"modules {', '.join(names)} are fused in asyncllm but only some are "
                "quantized in the checkpoint (quantization_config.ignore)"
            )
        shards = None
        if tp is not None:
            head_dim, vocab = model.head_dim, model.vocab_size
            shards = weight_shards(f"{path}.weight", srcs, tp, head_dim, vocab)  # type: ignore[arg-type]
        layer = load_compressed_linear(read, has, names, schemes, shards)  # type: ignore[arg-type]
        if isinstance(module, RowParallelLinear):
            layer = RowParallelQuantLinear.of(layer)
        _swap(model, path, module, layer)


def quantize_linears(model: nn.Module, method: str) -> None:
    """Quantize every linear layer of the decoder layers (the LM head and the
    embedding stay as they are, as llm-compressor's recipes leave them) in place.
    Under tensor parallelism each rank quantizes its own slice: column-parallel
    layers hold whole rows; a row-parallel layer's slice of the inputs must be a
    whole number of the groups the full row takes (ModelLoadError otherwise), so
    every rank's integers and scales are those of the unsharded model."""
    if method not in METHODS:
        raise ModelLoadError(f"quantization={method!r}: supported: {', '.join(METHODS)}")
    bits, group = METHODS[method]
    tp = getattr(model, "tp", None)
    for path, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not path.startswith("layers."):
            continue
        row_parallel = isinstance(module, RowParallelLinear)
        shards = tp.size if tp is not None and row_parallel else 1
        layer = quantize_weight(module.weight.detach(), bits, group, path, shards)
        if row_parallel:
            layer = RowParallelQuantLinear.of(layer)
        _swap(model, path, module, layer)
    _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand the freed float weights back to the OS: glibc keeps freed heap pages
    mapped (SmolLM2 from bf16, resident memory added by the load: int8 204 -> 192
    MiB, int4 168 -> 149 MiB; bf16 itself 271)."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc (musl): nothing to trim this way
        pass


def group_for(in_features: int, group_size: int) -> int:
    """`group_size`, else the largest half of it down to 32 that divides the row
    (SmolLM2's 576 takes 64 for 128), else the whole row."""
    for size in (group_size >> k for k in range(8)):
        if 32 <= size <= in_features and in_features % size == 0:
            return size
    return in_features


def quantize_weight(
    weight: torch.Tensor, bits: int, group_size: int, name: str = "weight", shards: int = 1
) -> QuantLinear:
    """Round-to-nearest symmetric quantization of a float [out, in] weight, one scale
    per group of inputs (`group_for` the full row of `in * shards` inputs, when this
    weight is one of `shards` column slices). ModelLoadError for a 4-bit row of odd
    length (two values a byte) or a slice that splits a group."""
    out, in_features = weight.shape
    if bits == 4 and in_features % 2:
        raise ModelLoadError(f"{name}: int4 packs two inputs a byte; {in_features} is odd")
    group = group_for(in_features * shards, group_size)
    if in_features % group:
        raise ModelLoadError(
            f"{name}: tensor_parallel_size={shards} gives each rank {in_features} of its "
            f"{in_features * shards} inputs, not a whole number of its groups of {group}"
        )
    w = weight.float().view(out, in_features // group, group)
    qmax = (1 << (bits - 1)) - 1
    scales = _f16_up(w.abs().amax(dim=2) / qmax)
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(w / scales[:, :, None]).clamp_(-qmax - 1, qmax).to(torch.int8)
    q = q.view(out, in_features)
    qweight = q if bits == 8 else pack_int4(q)
    return QuantLinear(qweight, bits, scales, None, in_features)


def _f16_up(scales: torch.Tensor) -> torch.Tensor:
    """Each scale rounded up to an f16 value (as float32), so that the weight has
    an exact GGUF form (`quant.as_gguf`: its blocks' scales are f16) and no weight
    passes the largest integer; past f16's range, as it is."""
    half = scales.half()
    low = half.float() < scales
    half[low] = (half[low].view(torch.int16) + 1).view(torch.float16)  # the next f16 up
    up = half.float()
    return torch.where(torch.isfinite(up) & (up > 0), up, scales)


def _swap(model: nn.Module, path: str, old: nn.Module, layer: QuantLinear) -> None:
    """Put `layer` at `path` in place of `old` (keeping its bias parameter)."""
    if layer.out_features != old.out_features or layer.in_features != old.in_features:
        raise ModelLoadError(
            f"{path}: the checkpoint's weight is [{layer.out_features}, {layer.in_features}], "
            f"the config implies [{old.out_features}, {old.in_features}]"
        )
    layer.bias = old.bias  # type: ignore[assignment]  # (an nn.Linear's Parameter or None)
    model.set_submodule(path, layer)
    if path == "lm_head":
        model.logits_head = layer
