"""The Llama family: Llama 2/3, Mistral, TinyLlama, SmolLM and Qwen2 (q/k/v bias).

The module takes a flattened batch (every sequence's tokens of this step, one after
another) and the paged KV cache; see `asyncllm.models.attention` for the layout.
q/k/v and gate/up projections are fused at load time; `weight_sources` tells the
loader which Hugging Face tensors make up each fused parameter.

The other families (qwen3, phi3, moe, gemma) subclass these classes and override
the hooks `decoder_layer`, `make_mlp`, `embed` and the attention's options rather
than copy them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models.attention import AttentionMetadata, paged_attention
from asyncllm.models.hf_config import layer_windows
from asyncllm.models.layers import (
    EAGER_OPS,
    FusedOps,
    RMSNorm,
    RotaryEmbedding,
    SwiGLUMLP,
    rope_parameters,
)
from asyncllm.models.parallel_state import tensor_parallel

if TYPE_CHECKING:
    from asyncllm.models.parallel_layers import TPLayout, VocabParallelEmbedding


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with a fused q/k/v projection.

    Options the other families turn on: `qk_norm` (a per-head norm module class
    applied to q and k before the rotation: Qwen3, Gemma 3), `window` (sliding-window
    attention over the last `window` positions), `softcap` (attention logit
    soft-capping: Gemma 2), `scale` (Gemma's query_pre_attn_scalar) and
    `rotary_dim` < head_dim (partial rotary: Phi-3)."""

    ops: FusedOps = EAGER_OPS

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool,
        *,
        qk_norm: Any = None,
        norm_eps: float = 1e-6,
        window: int | None = None,
        softcap: float | None = None,
        scale: float | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        self.scale = head_dim**-0.5 if scale is None else scale
        self.window = window
        self.softcap = softcap
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.qkv_proj = nn.Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, hidden_size, bias=False)
        self.q_norm = None if qk_norm is None else qk_norm(head_dim, norm_eps)
        self.k_norm = None if qk_norm is None else qk_norm(head_dim, norm_eps)

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
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat(
                (self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), 1
            )
        if self.rotary_dim == self.head_dim:
            qk = self.ops.rotary(qk, cos, sin)
        else:
            rot = self.ops.rotary(qk[..., : self.rotary_dim], cos, sin)
            qk = torch.cat((rot, qk[..., self.rotary_dim :]), dim=-1)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.window is None and self.softcap is None:
            out = paged_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            out = paged_attention(
                q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap
            )
        return self.o_proj(out)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP blocks with residual connections."""

    def __init__(self, attn: LlamaAttention, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        normed, hidden = self.post_attention_layernorm.add_forward(attn, hidden)
        return hidden + self.mlp(normed)


class LlamaForCausalLM(nn.Module):
    """Llama-family causal LM over a paged KV cache (the model runner's contract)."""

    attention_bias = False  # Qwen2 turns this on: biases on q, k and v
    qk_norm: Any = None  # Qwen3: RMSNorm per head on q and k
    # Set by the runner where the layers qualify: small all-decode steps run every
    # layer in one extension call (asyncllm.models.fused_decode.FusedDecode).
    fused_decode: Any = None

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        cfg = hf_config
        self.check_config(cfg)
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.num_layers: int = cfg.num_hidden_layers
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = _num_kv_heads(cfg)
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.tie_word_embeddings: bool = bool(getattr(cfg, "tie_word_embeddings", False))
        # Per layer: the sliding window it attends within, or None (every position).
        self.layer_windows: list[int | None] = layer_windows(cfg)
        # Tensor parallelism (models/parallel_layers.py): this rank's share of the
        # heads, MLP columns and vocabulary; None on one rank, whose path is untouched.
        self.tp: TPLayout | None = self._tp_layout(cfg)
        if self.tp is not None:
            self.num_kv_heads = self.tp.num_kv_heads  # what this rank's KV cache holds

        self.embed_tokens: nn.Embedding | VocabParallelEmbedding = self._make_embedding(cfg)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(self.num_layers))
        self.norm = self.make_norm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = self.make_rotary(cfg)
        vocab_rows = cfg.vocab_size if self.tp is None else self.tp.vocab_per_rank
        self.lm_head = (
            None if self.tie_word_embeddings else nn.Linear(cfg.hidden_size, vocab_rows, bias=False)
        )
        # Set by the runner's kernel selection (asyncllm.worker.linear_select): the LM
        # head on the kernels chosen for its shape (the embedding's weight when tied).
        self.logits_head: nn.Module | None = None
        if self.tp is not None:  # an instance attribute: one rank keeps the plain method
            self.compute_logits = self._compute_logits_tp  # type: ignore[method-assign]

    # Tensor parallelism: the classes whose layers have been checked sharded.
    def _tp_layout(self, cfg: Any) -> TPLayout | None:
        tp = tensor_parallel()
        if tp.size == 1:
            return None
        from asyncllm.errors import ModelLoadError
        from asyncllm.models.parallel_layers import TPLayout

        if type(self) not in (LlamaForCausalLM, Qwen2ForCausalLM):
            raise ModelLoadError(
                f"EngineArgs.tensor_parallel_size={tp.size}: {type(self).__name__} has no "
                "tensor-parallel layers (Llama, Mistral and Qwen2 have); use 1"
            )
        return TPLayout.of(cfg, self.num_kv_heads, tp.rank, tp.size)

    def _make_embedding(self, cfg: Any) -> nn.Embedding | VocabParallelEmbedding:
        if self.tp is None:
            return nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        from asyncllm.models.parallel_layers import VocabParallelEmbedding

        return VocabParallelEmbedding(self.tp.vocab_per_rank, cfg.hidden_size, self.tp.rank)

    def _compute_logits_tp(self, hidden: torch.Tensor) -> torch.Tensor:
        """`compute_logits` over the vocabulary shards: [n, vocab] on rank 0."""
        from asyncllm.models.parallel_layers import gather_logits

        assert self.tp is not None
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        local = F.linear(hidden, weight).float()
        return gather_logits(local, self.vocab_size, self.tp.rank, self.tp.size)

    # Hooks the other families override.
    def check_config(self, cfg: Any) -> None:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            from asyncllm.errors import ModelLoadError

            raise ModelLoadError(f"hidden_act {cfg.hidden_act!r} is not supported; only 'silu'")

    def make_norm(self, size: int, eps: float) -> nn.Module:
        return RMSNorm(size, eps)

    def make_attention(self, cfg: Any, layer: int) -> LlamaAttention:
        # Qwen2-MoE names its q/k/v bias `qkv_bias`.
        bias = bool(getattr(cfg, "attention_bias", False) or getattr(cfg, "qkv_bias", False))
        bias = bias or self.attention_bias
        attn = LlamaAttention(
            cfg.hidden_size,
            cfg.num_attention_heads if self.tp is None else self.tp.num_heads,
            self.num_kv_heads,
            self.head_dim,
            bias,
            qk_norm=self.qk_norm,
            norm_eps=cfg.rms_norm_eps,
            window=self.layer_windows[layer],
        )
        if self.tp is not None:
            from asyncllm.models.parallel_layers import RowParallelLinear

            attn.o_proj = RowParallelLinear(attn.q_size, cfg.hidden_size)
        return attn

    def make_mlp(self, cfg: Any, layer: int) -> nn.Module:
        if self.tp is None:
            return SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        from asyncllm.models.parallel_layers import RowParallelLinear

        mlp = SwiGLUMLP(cfg.hidden_size, self.tp.intermediate)
        mlp.down_proj = RowParallelLinear(self.tp.intermediate, cfg.hidden_size)
        return mlp

    # the decoder layer's class: a family with other norms around its blocks
    # (gemma's sandwich) names its own, built from the same parts
    decoder_layer: type[nn.Module] = LlamaDecoderLayer

    def make_layer(self, cfg: Any, layer: int) -> nn.Module:
        return self.decoder_layer(
            self.make_attention(cfg, layer),
            self.make_mlp(cfg, layer),
            cfg.hidden_size,
            cfg.rms_norm_eps,
        )

    def make_rotary(self, cfg: Any) -> RotaryEmbedding:
        return RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, rope_parameters(cfg))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] of the step's tokens (after the final norm)."""
        hidden = self.embed(input_ids)
        fused = self.fused_decode
        if fused is not None and fused.applies(attn_metadata, kv_caches):
            return self.norm(fused(hidden, positions, attn_metadata))
        cos, sin = self.rotary_emb.cos_sin(positions)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, vocab] of the rows the sampler needs."""
        if self.logits_head is not None:
            return self.logits_head(hidden).float()  # type: ignore[no-any-return]
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    def weight_sources(self) -> dict[str, list[str]]:
        """Our parameter name -> the checkpoint tensors concatenated (dim 0) to make it."""
        sources: dict[str, list[str]] = {}
        for name, _ in self.named_parameters():
            sources[name] = self.weight_source(name)
        return sources

    def weight_source(self, name: str) -> list[str]:
        """The checkpoint tensors of one parameter (see `weight_sources`)."""
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            return [f"model.{base}{p}_proj.{leaf}" for p in "qkv"]
        if prefix.endswith("gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            return [f"model.{base}{p}_proj.{leaf}" for p in ("gate", "up")]
        if name.startswith("lm_head."):
            return [name]
        return [f"model.{name}"]

    def init_buffers(self) -> None:
        """Compute the non-weight buffers once the weights are materialized."""
        weight = self.embed_tokens.weight
        self.rotary_emb.init_cache(weight.dtype, weight.device)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2: Llama with biases on the q, k and v projections."""

    attention_bias = True


def _num_kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
