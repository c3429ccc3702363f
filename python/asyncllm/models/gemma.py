"""Gemma 2 and Gemma 3 (text): GeGLU MLP (tanh-approximated GELU), embeddings
scaled by sqrt(hidden) in the model dtype, (1 + weight) RMSNorm, norms before and
after both attention and MLP, query_pre_attn_scalar, alternating sliding-window
and global layers; Gemma 2 soft-caps attention and final logits, Gemma 3 norms q
and k per head and gives local and global layers their own RoPE bases."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.errors import ModelLoadError
from asyncllm.models.attention import AttentionMetadata
from asyncllm.models.layers import RMSNorm, RotaryEmbedding, SwiGLUMLP, rope_parameters
from asyncllm.models.llama import LlamaAttention, LlamaForCausalLM


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + weight), all in float32 then cast back (as transformers)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeGLUMLP(SwiGLUMLP):
    """down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    """Sandwich norms: norm -> attention -> norm -> residual, same for the MLP."""

    def __init__(self, attn: LlamaAttention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 (2B, 9B, 27B)."""

    qk_norm: Any = None
    decoder_layer = GemmaDecoderLayer

    def check_config(self, cfg: Any) -> None:
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None)
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ModelLoadError(
                f"hidden_activation {act!r} is not supported; only 'gelu_pytorch_tanh'"
            )
        self.final_softcap: float | None = getattr(cfg, "final_logit_softcapping", None)

    def make_norm(self, size: int, eps: float) -> nn.Module:
        return GemmaRMSNorm(size, eps)

    def make_attention(self, cfg: Any, layer: int) -> LlamaAttention:
        bias = bool(getattr(cfg, "attention_bias", False))
        return LlamaAttention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            self.num_kv_heads,
            self.head_dim,
            bias,
            qk_norm=None if self.qk_norm is None else GemmaRMSNorm,
            norm_eps=cfg.rms_norm_eps,
            window=self.layer_windows[layer],
            softcap=getattr(cfg, "attn_logit_softcapping", None),
            scale=float(cfg.query_pre_attn_scalar) ** -0.5,
        )

    def make_mlp(self, cfg: Any, layer: int) -> nn.Module:
        return GeGLUMLP(cfg.hidden_size, cfg.intermediate_size)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        # transformers rounds sqrt(hidden) to the model dtype first.
        return hidden * torch.tensor(self.hidden_size**0.5, dtype=hidden.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.logits_head is not None:  # the kernels chosen at load
            logits = self.logits_head(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text (1B, and the language model of the larger ones when its config
    names Gemma3ForCausalLM): q/k norm, local layers on their own RoPE base."""

    qk_norm = GemmaRMSNorm

    def make_rotary(self, cfg: Any) -> RotaryEmbedding:
        self.local_rotary_emb = RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, gemma3_rope(cfg, "sliding_attention")
        )
        return RotaryEmbedding(
            self.head_dim, cfg.max_position_embeddings, gemma3_rope(cfg, "full_attention")
        )

    def init_buffers(self) -> None:
        super().init_buffers()
        weight = self.embed_tokens.weight
        self.local_rotary_emb.init_cache(weight.dtype, weight.device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = self.embed(input_ids)
        rope_global = self.rotary_emb.cos_sin(positions)
        rope_local = self.local_rotary_emb.cos_sin(positions)
        for layer, window, kv_cache in zip(self.layers, self.layer_windows, kv_caches, strict=True):
            cos, sin = rope_global if window is None else rope_local
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)


def gemma3_rope(cfg: Any, layer_type: str) -> dict[str, Any]:
    """One layer type's RoPE settings: transformers 5 nests them per layer type in
    `rope_parameters`; older configs give `rope_theta` (+ `rope_scaling`) for global
    layers and `rope_local_base_freq` for local ones."""
    nested = getattr(cfg, "rope_parameters", None)
    if isinstance(nested, dict) and layer_type in nested:
        params = dict(nested[layer_type])
        params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
        return params
    if layer_type == "full_attention":
        params = rope_parameters(cfg)
        params.setdefault("rope_theta", 1_000_000.0)
        return params
    base = getattr(cfg, "rope_local_base_freq", None) or 10_000.0
    return {"rope_type": "default", "rope_theta": float(base)}
