"""The Llama family: Llama 2/3, Mistral, TinyLlama, SmolLM and Qwen2 (q/k/v bias).

The module takes a flattened batch (every sequence's tokens of this step, one after
another) and the paged KV cache; see `asyncllm.models.attention` for the layout.
q/k/v and gate/up projections are fused at load time; `weight_sources` tells the
loader which Hugging Face tensors make up each fused parameter.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.attention import AttentionMetadata, paged_attention
from asyncllm.models.layers import (
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    apply_rotary,
    rope_parameters,
)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with a fused q/k/v projection."""

    def __init__(
        self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        # Rotate q and k together: one kernel per op instead of two.
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, -1, self.head_dim)
        qk = apply_rotary(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, cfg: Any, head_dim: int, bias: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(
            cfg.hidden_size, cfg.num_attention_heads, _num_kv_heads(cfg), head_dim, bias
        )
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (the model runner's contract)."""

    attention_bias = False  # Qwen2 turns this on: biases on q, k and v

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            from asyncllm.errors import ModelLoadError

            raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu'")
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = _num_kv_heads(cfg)
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.tie_word_embeddings: bool = bool(getattr(cfg, "tie_word_embeddings", False))
        bias = bool(getattr(cfg, "attention_bias", False)) or self.attention_bias
        # Mistral v0.1 attends to the last `sliding_window` keys only; this model attends
        # to all, which is the same up to that length: the runner caps max_model_len here.
        window = getattr(cfg, "sliding_window", None)
        use_window = getattr(cfg, "use_sliding_window", True)
        self.sliding_window: int | None = int(window) if window and use_window else None

        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, self.head_dim, bias) for _ in range(self.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg)
        )
        self.lm_head = (
            None
            if self.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens (after the final norm)."""
        hidden = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of the rows the sampler needs."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def weight_sources(self) -> dict[str, list[str]]:
        """Our parameter name -> the checkpoint tensors concatenated (dim 0) to make it."""
        sources: dict[str, list[str]] = {}
        for name, _ in self.named_parameters():
            prefix, _, leaf = name.rpartition(".")
            if prefix.endswith("qkv_proj"):
                base = prefix[: -len("qkv_proj")]
                sources[name] = [f"model.{base}{p}_proj.{leaf}" for p in "qkv"]
            elif prefix.endswith("gate_up_proj"):
                base = prefix[: -len("gate_up_proj")]
                sources[name] = [f"model.{base}{p}_proj.{leaf}" for p in ("gate", "up")]
            elif name.startswith("lm_head."):
                sources[name] = [name]
            else:
                sources[name] = [f"model.{name}"]
        return sources

    def init_buffers(self) -> None:
        """Compute the non-weight buffers once the weights are materialized."""
        weight = self.embed_tokens.weight
        self.rotary_emb.init_cache(weight.dtype, weight.device)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q, k and v projections."""

    attention_bias = True


def _num_kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
