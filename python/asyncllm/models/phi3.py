"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama with the checkpoint's q/k/v and gate/up
already fused (`qkv_proj`, `gate_up_proj`), partial rotary where configured, and
`longrope` scaling (separate short and long frequency factors)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from asyncllm.models.attention import AttentionMetadata
from asyncllm.models.hf_config import longrope_original
from asyncllm.models.layers import RotaryEmbedding, rope_inv_freq, rope_parameters
from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM


class LongRopeEmbedding(RotaryEmbedding):
    """LongRoPE, as transformers picks its factors: by the length of a forward
    pass, all its positions alike (long past `original_max_position_embeddings`,
    else short), both scaled by the attention factor. Through `generate` that
    means: a prompt longer than the original length rotates wholly with the long
    factors; a shorter one keeps the short factors, and its later tokens rotate
    with the long ones from the original length on. A paged cache keeps each
    token's key as it was first computed, so this is a per-sequence rule: the
    table holds the per-position rotation, then the all-long one, and a sequence
    whose prompt is longer reads the second half (`table_positions`). One case
    differs: when a shorter sequence grows past the original length, transformers'
    Phi-3 `generate` drops its cache and recomputes every token with the long
    factors; here the cached tokens keep their short-factor keys."""

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
        freqs = torch.cat((torch.where((t < self.original)[:, None], short, long), long))
        table = torch.stack([freqs.cos(), freqs.sin()], dim=1) * self.attention_factor
        self.cos_sin_cache = table.to(device=device, dtype=dtype)

    def table_positions(
        self, positions: torch.Tensor, prompt_lens: np.ndarray, query_lens: np.ndarray
    ) -> torch.Tensor:
        """The table rows of a step's tokens (sequences in batch order, `query_lens`
        tokens each): past the first half for a sequence whose prompt is longer
        than the original length."""
        long = prompt_lens > self.original
        if not long.any():
            return positions
        offset = np.repeat(long.astype(np.int64) * self.max_positions, query_lens)
        return positions + torch.from_numpy(offset).to(positions.device)


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 family (Phi3ForCausalLM in config.json)."""

    # With longrope, the runner passes each sequence's prompt length (metadata).
    uses_prompt_lens = False

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
        original = longrope_original(cfg)
        if original is not None:
            self.uses_prompt_lens = True
            return LongRopeEmbedding(dim, cfg.max_position_embeddings, params, original)
        rope_inv_freq(dim, params)  # an unsupported rope_type fails here, naming it
        return RotaryEmbedding(dim, cfg.max_position_embeddings, params)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        rotary = self.rotary_emb
        prompt_lens, query_lens = attn_metadata.prompt_lens, attn_metadata.query_lens
        if isinstance(rotary, LongRopeEmbedding) and prompt_lens is not None:
            assert query_lens is not None
            positions = rotary.table_positions(positions, prompt_lens, query_lens)
        return super().forward(input_ids, positions, kv_caches, attn_metadata)

    def weight_source(self, name: str) -> list[str]:
        # Already fused in the checkpoint under our names.
        return [name] if name.startswith("lm_head.") else [f"model.{name}"]
