"""Which of a model's layers take adapters, and which Hugging Face modules (the
names PEFT files use) each one fuses.

A target is one of our linear layers (`layers.3.self_attn.qkv_proj`) with the
checkpoint modules it was fused from, in order, and their output sizes
(`model.layers.3.self_attn.{q,k,v}_proj`). The names come from the model's own
`weight_source`, so a family that fuses or names its projections differently
needs no table here.

Under tensor parallelism a target also keeps the slice of each checkpoint module
its base layer holds (`models.parallel_layers.weight_shards`), so an adapter is cut
exactly as the base weight is: a column-parallel layer (rows of W: q/k/v by their
own heads, gate/up by their own columns) takes those rows of B; a row-parallel one
(columns of W: o, down) those columns of A. Sizes here are the rank's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from asyncllm.errors import ConfigError
from asyncllm.models.parallel_layers import Shard, weight_shards

# Our projections that take adapters (q/k/v, o, gate/up, down).
TARGET_LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class LoRATarget:
    """One adaptable layer: its module name in our model, the checkpoint modules
    it fuses (`sources`), their output sizes (`slices`) and its input size, as
    this rank holds them; with tensor parallelism, the slice of each source this
    rank's base weight holds (`shards`, None on one rank)."""

    name: str
    sources: tuple[str, ...]
    slices: tuple[int, ...]
    in_features: int
    shards: tuple[Shard, ...] | None = None


def find_targets(model: nn.Module) -> list[LoRATarget]:
    """Every adaptable layer of `model`. Raises ConfigError for a model whose
    layers we cannot adapt (no Llama-shaped projections)."""
    targets = []
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if leaf not in TARGET_LEAVES:
            continue
        weights = model.weight_source(f"{name}.weight")  # type: ignore[operator]
        sources = tuple(s.removesuffix(".weight") for s in weights)
        slices = _slices(model, name, module, len(sources))
        layout: Any = getattr(model, "tp", None)
        shards = None
        if layout is not None:
            head_dim, vocab = model.head_dim, model.vocab_size
            shards = tuple(weight_shards(f"{name}.weight", weights, layout, head_dim, vocab))  # type: ignore[arg-type]
        in_features = int(module.in_features)  # type: ignore[arg-type]
        targets.append(LoRATarget(name, sources, slices, in_features, shards))
    if not targets:
        raise ConfigError(
            f"EngineArgs.enable_lora: {type(model).__name__} has none of the layers "
            f"adapters attach to ({', '.join(TARGET_LEAVES)})"
        )
    return targets


def _slices(model: nn.Module, name: str, module: Any, num_sources: int) -> tuple[int, ...]:
    out = int(module.out_features)
    if num_sources == 1:
        return (out,)
    if name.endswith("qkv_proj") and num_sources == 3:
        attn: Any = model.get_submodule(name.rpartition(".")[0])
        return (int(attn.q_size), int(attn.kv_size), int(attn.kv_size))
    if out % num_sources:
        raise ConfigError(f"EngineArgs.enable_lora: cannot split {name}'s {out} outputs")
    return (out // num_sources,) * num_sources
