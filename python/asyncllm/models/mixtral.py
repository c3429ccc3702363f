"""Mixtral: Mistral attention with a sparse mixture-of-experts MLP (`moe`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.moe import SparseMoE, expert_sources


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral 8x7B / 8x22B and the small Mixtral-style models."""

    def make_mlp(self, cfg: Any, layer: int) -> nn.Module:
        self.num_experts = int(cfg.num_local_experts)
        return SparseMoE(
            cfg.hidden_size,
            self.num_experts,
            int(cfg.num_experts_per_tok),
            cfg.intermediate_size,
            renormalize=True,
        )

    def weight_source(self, name: str) -> list[str]:
        prefix, _, leaf = name.rpartition(".")
        if ".mlp." in f".{name}":
            moe = "model." + name.split(".mlp.")[0] + ".block_sparse_moe"
            if leaf == "experts_gate_up":
                return expert_sources(moe, self.num_experts, ("w1", "w3"))
            if leaf == "experts_down":
                return expert_sources(moe, self.num_experts, ("w2",))
            return [f"{moe}.gate.weight"]
        return super().weight_source(name)
