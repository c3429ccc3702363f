"""compressed-tensors checkpoints (what llm-compressor writes and vLLM loads), read
into `QuantLinear` layers without dequantizing.

config.json's `quantization_config` (quant_method "compressed-tensors") names, per
group of target modules, how each Linear's weight and inputs are quantized. The
schemes read here:

    int-quantized / naive-quantized, 8-bit int weights (per-channel, per-tensor or
        per-group scales), inputs float (W8A16) or dynamic per-token symmetric int8
        (W8A8): tensors `weight` (int8), `weight_scale`, `weight_zero_point` (only
        when asymmetric)
    pack-quantized, 4-bit int weights (per-group or per-channel, symmetric or not),
        float inputs (W4A16): `weight_packed` (int32, eight values a word, value i
        at bits 4i..4i+3 stored as q + 8), `weight_scale`, `weight_shape`, and for
        asymmetric weights `weight_zero_point` packed the same way along the output
        dimension

Anything else (float8, static activation scales, activation reordering with
g_idx, other bit widths) is a ModelLoadError naming the module and the setting.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncllm.errors import ModelLoadError
from asyncllm.models.parallel_layers import Shard
from asyncllm.models.quant.layers import QuantLinear, unpack_int4

_INT_FORMATS = ("int-quantized", "naive-quantized")
_PACKED_FORMATS = ("pack-quantized",)
_WEIGHT_STRATEGIES = ("channel", "group", "tensor")


@dataclass(frozen=True)
class Scheme:
    """How one checkpoint module's weight is stored and its inputs are treated."""

    format: str
    bits: int
    symmetric: bool
    act_quant: bool


def compressed_config(hf_config: Any) -> dict[str, Any] | None:
    """The compressed-tensors `quantization_config`, None when the checkpoint is not
    one; ModelLoadError for another quantization method or a checkpoint not saved
    compressed."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "compressed-tensors":
        raise ModelLoadError(
            f"quantization_config.quant_method={method!r} is not supported: asyncllm reads "
            "'compressed-tensors' checkpoints (and GGUF files)"
        )
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelLoadError(
            f"quantization_config.quantization_status={status!r}: only checkpoints saved "
            "compressed (integer weights) are read"
        )
    return qc


def scheme_of(qc: dict[str, Any], module: str) -> Scheme | None:
    """The scheme of checkpoint Linear `module` (e.g. "model.layers.0.mlp.up_proj"),
    None when it is left in float (ignored or not targeted)."""
    if any(_matches(pattern, module) for pattern in qc.get("ignore") or []):
        return None
    for name, group in (qc.get("config_groups") or {}).items():
        if any(_matches(t, module) for t in group.get("targets") or []):
            return _scheme(name, group, qc.get("format"), module)
    return None


def _matches(target: str, module: str) -> bool:
    """compressed-tensors' target rules: a class name (all our targets are Linear),
    "re:" + a regular expression matched at the start, or the module's name."""
    if target == "Linear":
        return True
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _scheme(name: str, group: dict[str, Any], default_format: Any, module: str) -> Scheme:
    where = f"quantization_config.config_groups.{name} (module {module})"
    fmt = group.get("format") or default_format
    weights = group.get("weights") or {}
    bits, wtype, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    if not ((fmt in _INT_FORMATS and bits == 8) or (fmt in _PACKED_FORMATS and bits == 4)):
        raise ModelLoadError(
            f"{where}: format={fmt!r} with num_bits={bits!r} is not supported; supported: "
            "int-quantized 8-bit (W8A8, W8A16) and pack-quantized 4-bit (W4A16)"
        )
    if wtype != "int" or strategy not in _WEIGHT_STRATEGIES or weights.get("dynamic"):
        raise ModelLoadError(
            f"{where}: weights type={wtype!r}, strategy={strategy!r}, dynamic="
            f"{weights.get('dynamic')!r}; supported: static int weights with "
            f"strategy in {_WEIGHT_STRATEGIES}"
        )
    if weights.get("actorder") == "group":
        raise ModelLoadError(f"{where}: actorder='group' (a g_idx permutation) is not supported")
    if group.get("output_activations"):
        raise ModelLoadError(f"{where}: quantized output activations are not supported")
    act_quant = _input_quant(where, group.get("input_activations"), bits, strategy)
    return Scheme(fmt, bits, bool(weights.get("symmetric", True)), act_quant)


def _input_quant(where: str, inputs: dict[str, Any] | None, bits: int, strategy: str) -> bool:
    """True for dynamic per-token int8 inputs (W8A8), False for float inputs."""
    if not inputs:
        return False
    ok = (
        inputs.get("type") == "int"
        and inputs.get("num_bits") == 8
        and inputs.get("strategy") == "token"
        and inputs.get("dynamic") is True
        and inputs.get("symmetric", True)
        and bits == 8
        and strategy in ("channel", "tensor")
    )
    if not ok:
        raise ModelLoadError(
            f"{where}: input_activations {inputs} are not supported; supported: dynamic "
            "per-token symmetric int8 with 8-bit per-channel or per-tensor weights"
        )
    return True


Reader = Callable[[str], torch.Tensor]


def load_compressed_linear(
    read: Reader,
    has: Callable[[str], bool],
    modules: list[str],
    schemes: list[Scheme],
    shards: list[Shard] | None = None,
) -> QuantLinear:
    """One QuantLinear over checkpoint modules `modules` (several: a fused q/k/v or
    gate/up, stacked by output rows), which must share a scheme; with `shards` (one
    per module: tensor parallelism), only this rank's rows or input columns."""
    if len(set(schemes)) != 1:
        raise ModelLoadError(
            f"modules {', '.join(modules)} are fused in asyncllm but quantized differently "
            f"in the checkpoint ({', '.join(sorted({str(s) for s in schemes}))})"
        )
    scheme = schemes[0]
    parts = [_read_part(read, has, m, scheme) for m in modules]
    if shards is not None:
        cuts = zip(parts, shards, modules, strict=True)
        parts = [_slice(part, shard, scheme.bits, m) for part, shard, m in cuts]
    in_features = parts[0][3]
    groups = {p[1].shape[1] for p in parts}
    if len(groups) != 1 or any(p[3] != in_features for p in parts):
        raise ModelLoadError(
            f"modules {', '.join(modules)}: fused parts need the same input size and "
            f"number of scale groups (got {[(p[3], p[1].shape[1]) for p in parts]})"
        )
    qweight = torch.cat([p[0] for p in parts])
    scales = torch.cat([p[1] for p in parts])
    zeros = None if scheme.symmetric else torch.cat([p[2] for p in parts])  # type: ignore[misc]
    try:
        return QuantLinear(qweight, scheme.bits, scales, zeros, in_features, None, scheme.act_quant)
    except ValueError as e:
        raise ModelLoadError(f"modules {', '.join(modules)}: {e}") from e


# One checkpoint module's (qweight, scales [out, groups] float32, zeros int8 or None,
# in_features).
Part = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]


def _read_part(read: Reader, has: Callable[[str], bool], module: str, scheme: Scheme) -> Part:
    """(qweight, scales [out, groups] float32, zeros int8 or None, in_features)."""
    if has(f"{module}.weight_g_idx"):
        raise ModelLoadError(f"{module}.weight_g_idx: activation reordering is not supported")
    if scheme.bits == 8:
        qweight = read(f"{module}.weight")
        if qweight.dtype != torch.int8 or qweight.dim() != 2:
            raise ModelLoadError(
                f"{module}.weight is {qweight.dtype} {tuple(qweight.shape)}, expected int8 "
                "[out, in] for an int-quantized checkpoint"
            )
        out, in_features = qweight.shape
    else:
        packed = read(f"{module}.weight_packed")
        out, in_features = (int(v) for v in read(f"{module}.weight_shape").tolist())
        if packed.dtype != torch.int32 or tuple(packed.shape) != (out, in_features // 8):
            raise ModelLoadError(
                f"{module}.weight_packed is {packed.dtype} {tuple(packed.shape)}, expected "
                f"int32 [{out}, {in_features // 8}] for weight_shape [{out}, {in_features}]"
            )
        _require_little_endian()
        qweight = packed.contiguous().view(torch.uint8)  # value 2j low nibble of byte j
    scales = _per_row(read(f"{module}.weight_scale").float(), out, module, "weight_scale")
    zeros = None
    if not scheme.symmetric:
        raw = read(f"{module}.weight_zero_point")
        zeros = _zeros(raw, scheme.bits, out, scales.shape[1], module)
    return qweight, scales, zeros, in_features


def _slice(part: Part, shard: Shard, bits: int, module: str) -> Part:
    """A tensor-parallel rank's rows (dim 0) or input columns (dim 1) of one part.
    Columns are cut on group boundaries (each rank keeps whole groups, their scales
    and zero points), else ModelLoadError naming the module."""
    qweight, scales, zeros, in_features = part
    if shard.dim is None:
        return part
    lo, hi = shard.start, shard.stop
    if shard.dim == 0:
        rows = slice(lo, hi)
        return qweight[rows], scales[rows], None if zeros is None else zeros[rows], in_features
    group = in_features // scales.shape[1]
    if lo % group or hi % group:
        raise ModelLoadError(
            f"{module}: a rank's input columns [{lo}, {hi}) split its groups of {group} "
            "(tensor_parallel_size must give each rank whole groups)"
        )
    per_byte = 8 // bits
    cols, groups = slice(lo // per_byte, hi // per_byte), slice(lo // group, hi // group)
    sliced_zeros = None if zeros is None else zeros[:, groups].contiguous()
    return qweight[:, cols].contiguous(), scales[:, groups].contiguous(), sliced_zeros, hi - lo


def _per_row(t: torch.Tensor, out: int, module: str, name: str) -> torch.Tensor:
    """A per-tensor ([], [1]) or per-channel ([out], [out, 1]) or per-group
    ([out, groups]) tensor as [out, groups]."""
    if t.numel() == 1:
        return t.reshape(1, 1).expand(out, 1).contiguous()
    if t.dim() == 1 and t.shape[0] == out:
        return t.view(out, 1)
    if t.dim() == 2 and t.shape[0] == out:
        return t
    raise ModelLoadError(f"{module}.{name} has shape {tuple(t.shape)}, expected [{out}, groups]")


def _zeros(raw: torch.Tensor, bits: int, out: int, groups: int, module: str) -> torch.Tensor:
    """The zero points as int8 [out, groups] in the integers' own range."""
    if bits == 8:
        return _per_row(raw, out, module, "weight_zero_point").to(torch.int8)
    if raw.dtype != torch.int32 or tuple(raw.shape) != ((out + 7) // 8, groups):
        raise ModelLoadError(
            f"{module}.weight_zero_point is {raw.dtype} {tuple(raw.shape)}, expected int32 "
            f"[{(out + 7) // 8}, {groups}] (4-bit zero points packed along the outputs)"
        )
    _require_little_endian()
    by_group = raw.t().contiguous().view(torch.uint8)  # [groups, ceil(out / 2)]
    return unpack_int4(by_group)[:, :out].t().contiguous()


def _require_little_endian() -> None:
    if sys.byteorder != "little":
        raise ModelLoadError("packed int4 checkpoints are read on little-endian machines only")
