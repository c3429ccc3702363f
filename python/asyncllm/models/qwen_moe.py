"""Qwen2-MoE (shared expert with a sigmoid gate, q/k/v bias) and Qwen3-MoE (q/k
norm, no shared expert): the Qwen attention with the `moe` MLP on the layers the
config makes sparse (`decoder_sparse_step`, `mlp_only_layers`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from asyncllm.models.layers import RMSNorm, SwiGLUMLP
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.moe import SparseMoE, expert_sources


class Qwen2MoeForCausalLM(LlamaForCausalLM):
    """Qwen1.5-MoE / Qwen2-57B-A14B."""

    shared_expert = True  # q/k/v bias: the config's `qkv_bias`

    def make_mlp(self, cfg: Any, layer: int) -> nn.Module:
        # transformers 5 saves Qwen3-MoE's count as `num_local_experts`.
        self.num_experts = int(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = layer in (getattr(cfg, "mlp_only_layers", None) or [])
        if dense or self.num_experts == 0 or (layer + 1) % step != 0:
            return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        shared = int(cfg.shared_expert_intermediate_size) if self.shared_expert else 0
        return SparseMoE(
            cfg.hidden_size,
            self.num_experts,
            int(cfg.num_experts_per_tok),
            int(cfg.moe_intermediate_size),
            renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
            shared_intermediate_size=shared,
        )

    def weight_source(self, name: str) -> list[str]:
        leaf = name.rpartition(".")[2]
        if leaf in ("experts_gate_up", "experts_down"):
            moe = "model." + name.rpartition(".")[0]
            projections = ("gate_proj", "up_proj") if leaf == "experts_gate_up" else ("down_proj",)
            return expert_sources(moe, self.num_experts, projections)
        return super().weight_source(name)


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    """Qwen3-30B-A3B / 235B-A22B: per-head q/k RMSNorm, no bias, no shared expert."""

    shared_expert = False
    qk_norm = RMSNorm
