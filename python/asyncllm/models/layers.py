"""Building blocks of the Llama family: RMSNorm, rotary embedding, SwiGLU MLP.

Each layer keeps its weights in the shape the fused loader produces (gate and up
projections stacked in one matrix) so that a decode step runs one matmul where
Hugging Face runs two.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ModelLoadError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Root-mean-square norm over the last dim, computed in float32 as Hugging Face
    does, so that bf16/fp16 models match the reference."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x): a block's output joins the residual
    stream and the next block's norm reads it, in one pass when compiled."""
    summed = residual + x
    return rms_norm(summed, weight, eps), summed


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, from the fused gate/up projection's output [T, 2 * I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] (any strides) by cos/sin [T, 1, D/2]; returns a new tensor."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@dataclass(frozen=True)
class FusedOps:
    """The elementwise work between the matmuls, as functions a model's layers call
    through their `ops` attribute: eager by default; `asyncllm.worker.compile`
    gives a model's layers torch.compile'd versions (one fused pass each)."""

    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor] = rms_norm
    add_rms_norm: Callable[
        [torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]
    ] = add_rms_norm
    silu_mul: Callable[[torch.Tensor], torch.Tensor] = silu_mul
    rotary: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = apply_rotary


EAGER_OPS = FusedOps()


def set_ops(model: nn.Module, ops: FusedOps, only_replacing: FusedOps | None = None) -> int:
    """Give every module of `model` that calls `FusedOps` these ops (with
    `only_replacing`: only those that still have that set); returns how many."""
    count = 0
    for module in model.modules():
        if not isinstance(getattr(type(module), "ops", None), FusedOps):
            continue
        if only_replacing is None or getattr(module, "ops", None) is only_replacing:
            setattr(module, "ops", ops)  # noqa: B010 (nn.Module's typed __setattr__)
            count += 1
    return count


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32 (`rms_norm`)."""

    ops: FusedOps = EAGER_OPS

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x): see `add_rms_norm`."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class SwiGLUMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one projection."""

    ops: FusedOps = EAGER_OPS

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_mul(self.gate_up_proj(x)))


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The RoPE settings of a config, from transformers 5's `rope_parameters` or the
    older `rope_scaling` + `rope_theta` pair (checkpoints carry either)."""
    params = getattr(hf_config, "rope_parameters", None)
    if not params:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, params: dict[str, Any]) -> torch.Tensor:
    """Inverse frequencies [head_dim/2], with the scaling the config asks for; float32
    arithmetic as in Hugging Face, so far positions rotate identically."""
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / base**exponents
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        factor = float(params["factor"])
        low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
        old_len = float(params["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(
        f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


class RotaryEmbedding(nn.Module):
    """Rotary position embedding in Hugging Face's rotate-half layout.

    The cos/sin table covers every position up to `max_positions`; the model looks it
    up once per step (`cos_sin(positions)`) and every layer reuses the result.
    """

    def __init__(self, head_dim: int, max_positions: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, params)
        self.cos_sin_cache: torch.Tensor
        self.register_buffer("cos_sin_cache", torch.empty(0), persistent=False)

    def init_cache(self, dtype: torch.dtype, device: torch.device) -> None:
        """Fill the [max_positions, 2, head_dim/2] table; called after the module is
        materialized, since modules are built on the meta device."""
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, self.inv_freq)
        table = torch.stack([freqs.cos(), freqs.sin()], dim=1)
        self.cos_sin_cache = table.to(device=device, dtype=dtype)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, 1, head_dim/2] for the step's positions."""
        cs = self.cos_sin_cache.index_select(0, positions)
        return cs[:, 0:1], cs[:, 1:2]
