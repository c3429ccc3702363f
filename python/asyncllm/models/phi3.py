"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with the checkpoint's q/k/v and gate/up
already fused (`qkv_proj`, `gate_up_proj`), partial rotary where configured, and
`longrope` scaling (separate short and long frequency factors)."""

from __future__ import annotations

import math
from typing import Any

import torch

from asyncllm.models.layers import RotaryEmbedding, rope_inv_freq, rope_parameters
from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE: positions below `original_max_position_embeddings` rotate with the
    short factors, later ones with the long factors, both scaled by the attention
    factor. transformers switches a whole forward pass to the long factors once
    it passes the original length; per position is what a paged cache can keep
    consistent (a token's cached key never changes), and equals it below that."""

    def __init__(
        self, head_dim: int, max_positions: int, params: dict[str, Any], original: int
    ) -> None:
        base = float(params.get("rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        self.short_inv_freq = 1.0 / (torch.tensor(params["short_factor"]) * base**exponents)
        self.long_inv_freq = 1.0 / (torch.tensor(params["long_factor"]) * base**exponents)
        super().__init__(head_dim, max_positions, {"rope_type": "default", "rope_theta": base})
        self.original = original
        factor = params.get("factor") or max_positions / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            attention_factor = (
                1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
            )
        self.attention_factor = float(attention_factor)

    def init_cache(self, dtype: torch.dtype, device: torch.device) -> None:
        t = torch.arange(self.max_positions, dtype=torch.float32)
        short = torch.outer(t, self.short_inv_freq)
        long = torch.outer(t, self.long_inv_freq)
        freqs = torch.where((t < self.original)[:, None], short, long)
        table = torch.stack([freqs.cos(), freqs.sin()], dim=1) * self.attention_factor
        self.cos_sin_cache = table.to(device=device, dtype=dtype)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family (Phi3ForCausalLM in config.json)."""

    def make_attention(self, cfg: Any, layer: int) -> LlamaAttention:
        attn = super().make_attention(cfg, layer)
        attn.rotary_dim = self.rotary_dim(cfg)
        return attn

    def rotary_dim(self, cfg: Any) -> int:
        params = rope_parameters(cfg)
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        return int(self.head_dim * float(factor or 1.0))

    def make_rotary(self, cfg: Any) -> RotaryEmbedding:
        params = rope_parameters(cfg)
        dim = self.rotary_dim(cfg)
        if params["rope_type"] == "longrope":
            original = params.get("original_max_position_embeddings") or getattr(
                cfg, "original_max_position_embeddings", cfg.max_position_embeddings
            )
            return LongRopeEmbedding(dim, cfg.max_position_embeddings, params, int(original))
        rope_inv_freq(dim, params)  # an unsupported rope_type fails here, naming it
        return RotaryEmbedding(dim, cfg.max_position_embeddings, params)

    def weight_source(self, name: str) -> list[str]:
        # Already fused in the checkpoint under our names.
        return [name] if name.startswith("lm_head.") else [f"model.{name}"]
