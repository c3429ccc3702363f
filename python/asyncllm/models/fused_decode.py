"""A decode step's decoder layers in one call to the extension
(`_core._DecodePlan`, rust/kernels/decode_layers.rs).

Why: at one to a few rows a decode step is bound by reading the weights, but on
the torch path each layer also runs ~20 small ops between its matrix-vector
products, and every product streams megabytes through the caches, evicting the
interpreter's and the dispatcher's working set: the ops that follow pay for it
(on a Xeon VM an `x + x` of 512 floats took 1.7 µs in a loop, 80 µs right after a
16 MB read). In one call the work between the products is a few microseconds.

It serves Llama-shaped layers only (Llama, Mistral, Qwen2, SmolLM: pre-norm
RMSNorm, fused q/k/v with optional bias, rotate-half rotary over the whole head,
SwiGLU), on CPU, float32 or bfloat16, with every projection on the checkpoint's
layout (a weight reordered for oneDNN cannot be read here) or in GGUF blocks
(`models.gguf`: then only for the row counts where every GGUF layer chose the
integer kernel, which the fused call runs), and steps of at most `MAX_ROWS` tokens
(with GGUF layers up to `GGUF_MAX_TOKENS`) whose every token attends as a decode:
decodes, speculative decoding's verification tokens and, with GGUF layers, the
prompt tokens the CPU attends token-wise (`step_inputs.gather_step_inputs`'s
`prompt_runs`: the same attention kernel either way). Anything else takes the
torch path.

The numbers are the torch path's: the kernel rounds to the model's dtype wherever
the torch path holds a tensor, and runs the same matrix-vector and attention
kernels; only exp (SiLU, the extension's own, as on the torch path's native ops)
and the square root (RMSNorm) are not torch's, so a bfloat16 value now and then
differs in its last bit (tests/test_fused_decode.py bounds it). A row's result
does not depend on the rows beside it.

With LoRA (`with_adapters`, set up by `lora.model`), the call also adds each
adapted row's products to its projections' outputs, by the kernel `LoRALinear`
runs on the torch path, so a step with adapted rows stays on this path.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from asyncllm import _core
from asyncllm.models import kernel_rows
from asyncllm.models.attention import AttentionMetadata
from asyncllm.models.gguf.layers import (
    FUSED_MAX_ROWS,
    INT_TYPES,
    GGUFEmbedding,
    GGUFLinear,
    bucket_index,
)
from asyncllm.models.layers import EAGER_OPS, RMSNorm, RotaryEmbedding, SwiGLUMLP
from asyncllm.models.linear_kernels import KernelLinear, as_buffer
from asyncllm.models.native_ops import NATIVE_OPS

logger = logging.getLogger(__name__)

# Decode rows a fused step takes. Beyond a few rows the matrix-vector kernel does
# the FLOPs without a GEMM's blocking and the per-op cost matters less.
MAX_ROWS = 8
# With GGUF layers the call runs the integer kernel the torch path runs at every row
# count where gguf_select chose it (up to 16 rows it is the only choice), so it
# takes those steps too, up to GGUF_MAX_TOKENS tokens: a speculative verification
# (its kernels chosen by its decode step's rows, `kernel_rows`) or a prompt that
# attends token-wise. On the torch path such a step's ~150 kernel calls go through
# Python one by one, with the torch ops between them: at 16 streams a tenth of a
# verification step; a quarter of a 110-token SmolLM2 prefill (Zen 5). Long prompts
# too: the call took 0.76-0.87x the torch path's time at 512, 1,000 and 2,000
# tokens (SmolLM2 Q4_1, Zen 5), where a cap of 256 had sent them to the torch path;
# the cap is SmolLM2's context, twice the default step budget. Beyond the layer
# buckets' last (256 rows), a step runs that bucket's kernels on either path.
GGUF_MAX_ROWS = FUSED_MAX_ROWS
GGUF_MAX_TOKENS = 8192


class FusedDecode:
    """The model's layers as one `_DecodePlan`, for steps `applies` accepts."""

    def __init__(
        self,
        layers: list[tuple[Any, ...]],
        dims: tuple[Any, ...],
        rotary: RotaryEmbedding,
        kv_caches: list[torch.Tensor],
        num_threads: int,
        buckets: frozenset[int] | None = None,
    ) -> None:
        """The plan of `layers` (each layer's buffers, `_layer_buffers`, with LoRA
        its adapters too) and `dims` (the model's sizes, as `_DecodePlan` takes
        them)."""
        self.plan = _core._DecodePlan(layers, *dims)
        self.layers, self.dims = layers, dims  # what the plan was made of
        # with adapters: the step's token -> slot map (-1: none; None: no adapted
        # token), set before each step by lora.model.LoRAModel.begin_step
        self.lora_slots: np.ndarray | None = None
        self.rotary = rotary
        self.kv_caches = kv_caches  # the runner's list: a step with another one is not ours
        self.num_threads = num_threads
        # With GGUF layers, the row buckets whose chosen kernels the call computes
        # (None: every bucket, float weights only).
        self.buckets = buckets
        self.max_tokens = MAX_ROWS if buckets is None else GGUF_MAX_TOKENS

    @classmethod
    def build(
        cls, model: Any, kv_caches: list[torch.Tensor], num_threads: int
    ) -> FusedDecode | None:
        """The plan for `model`, or None (logged) when it has a part the kernel
        does not implement."""
        reason = unsupported(model, kv_caches)
        if reason is not None:
            logger.info("fused decode off: %s", reason)
            return None
        pairs = zip(model.layers, kv_caches, strict=True)
        layers = [_layer_buffers(layer, cache) for layer, cache in pairs]
        attn = model.layers[0].self_attn
        dims = (
            model.hidden_size,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            model.layers[0].mlp.intermediate_size,
            float(model.layers[0].input_layernorm.eps),
            float(attn.scale),
        )
        return cls(layers, dims, model.rotary_emb, kv_caches, num_threads, _gguf_buckets(model))

    def with_adapters(self, adapters: list[tuple[Any, ...]]) -> FusedDecode:
        """This step with LoRA: `adapters` per layer, for its qkv, o, gate_up and
        down projections, None or the slots as the rust kernel reads them
        (`LoRALinear.kernel_operands`: views the plan keeps, so later slot writes
        are seen)."""
        layers = [(*layer, ad) for layer, ad in zip(self.layers, adapters, strict=True)]
        return FusedDecode(
            layers, self.dims, self.rotary, self.kv_caches, self.num_threads, self.buckets
        )

    def applies(self, meta: AttentionMetadata, kv_caches: list[torch.Tensor]) -> bool:
        if meta.num_tokens > self.max_tokens or kv_caches is not self.kv_caches:
            return False
        # GGUF layers: the bucket they would choose by (a verification: its decode step's)
        rows = kernel_rows.rows or meta.num_tokens
        if self.buckets is None:
            return rows <= MAX_ROWS and _each_a_decode(meta, prompts=False)
        return bucket_index(rows) in self.buckets and _each_a_decode(meta, prompts=True)

    def __call__(
        self, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Every layer over `hidden` [m, hidden] (the embeddings, updated in place)."""
        rows = _rows(meta)
        cos_sin = self.rotary.cos_sin_cache.index_select(0, positions)
        self.plan.run(
            as_buffer(hidden),
            as_buffer(cos_sin),
            meta.slot_mapping.numpy(),
            *rows,
            self.num_threads,
            self.lora_slots,
        )
        return hidden


def _each_a_decode(meta: AttentionMetadata, prompts: bool) -> bool:
    """Whether every token of the step attends as a decode of its own: decodes, then
    tokens that attend token-wise: speculative decoding's verifications (a
    request's last token and its drafts, each bounded by its own position) and,
    when `prompts`, prompt tokens (`token_wise_spans` None: every span of the step
    is token-wise). The kernel writes every row's K/V before any row attends, so
    each token sees the ones before it, as the torch path's do."""
    if meta.num_decodes == meta.num_tokens:
        return meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    tw, spans = meta.token_wise, meta.token_wise_spans
    if tw is None or meta.num_decodes + len(tw[1]) != meta.num_tokens:
        return False
    # spans given: the verifications are token-wise; every span must be one
    return spans == len(meta.prefills) if spans is not None else prompts


def _rows(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """Each token's block table and seq_len, for a step `_each_a_decode` accepted."""
    tables, lens, tw = meta.decode_block_tables, meta.decode_seq_lens, meta.token_wise
    if meta.num_decodes == meta.num_tokens:
        assert tables is not None and lens is not None
        return tables.numpy(), lens.numpy()
    assert tw is not None
    if tables is None or lens is None or meta.num_decodes == 0:
        return tw[0].numpy(), tw[1].numpy()
    width = max(tables.shape[1], tw[0].shape[1])
    both = np.zeros((meta.num_tokens, width), dtype=np.int64)
    both[: meta.num_decodes, : tables.shape[1]] = tables.numpy()
    both[meta.num_decodes :, : tw[0].shape[1]] = tw[0].numpy()
    return both, np.concatenate((lens.numpy(), tw[1].numpy())).astype(np.int64)


def unsupported(model: Any, kv_caches: list[torch.Tensor] | None = None) -> str | None:
    """Why the kernel cannot run `model`'s layers, or None when it can; without
    `kv_caches`, whether it could once they are allocated (the runner asks before
    choosing the layers' kernels)."""
    from asyncllm.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM) or getattr(model, "tp", None) is not None:
        return f"{type(model).__name__} (tensor-parallel or not a Llama-family model)"
    cls = type(model)
    if cls.forward is not LlamaForCausalLM.forward or cls.embed is not LlamaForCausalLM.embed:
        return f"{cls.__name__} has its own forward or embedding"
    if type(model.rotary_emb) is not RotaryEmbedding:
        return f"{type(model.rotary_emb).__name__} rotary"
    embed = model.embed_tokens
    if isinstance(embed, GGUFEmbedding):
        where, dtype = embed.raw.device.type, embed.dtype
    elif isinstance(embed, nn.Embedding):
        where, dtype = embed.weight.device.type, embed.weight.dtype
    else:
        return f"a {type(embed).__name__} embedding"
    if where != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return f"{where} {dtype}"
    if kv_caches is not None and len(kv_caches) != len(model.layers):
        return "a KV cache per layer"
    for i, layer in enumerate(model.layers):
        cache = None if kv_caches is None else kv_caches[i]
        reason = _layer_unsupported(layer, cache, LlamaDecoderLayer, LlamaAttention)
        if reason is not None:
            return reason
    return None


def _layer_unsupported(
    layer: Any, cache: torch.Tensor | None, layer_cls: Any, attn_cls: Any
) -> str | None:
    if type(layer) is not layer_cls:
        return f"{type(layer).__name__} layers"
    attn, mlp = layer.self_attn, layer.mlp
    if type(attn) is not attn_cls or type(mlp) is not SwiGLUMLP:
        return f"{type(attn).__name__} / {type(mlp).__name__}"
    if attn.q_norm is not None or attn.window is not None or attn.softcap is not None:
        return "q/k norms, sliding windows or soft-capping"
    if attn.rotary_dim != attn.head_dim:
        return "partial rotary"
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    ops = (EAGER_OPS, NATIVE_OPS)
    if any(type(n) is not RMSNorm or n.ops not in ops for n in norms):
        return "norms other than RMSNorm, or compiled ones"
    if attn.ops not in ops or mlp.ops not in ops or norms[0].eps != norms[1].eps:
        return "compiled layers"
    for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
        if isinstance(linear, KernelLinear):
            if "onednn" in linear.kernels:
                return "a projection reordered for oneDNN"
        elif type(linear) is GGUFLinear:
            if linear.part0.device.type != "cpu":
                return "GGUF blocks off the CPU"
        elif type(linear) is not nn.Linear:
            return f"{type(linear).__name__} projections"
    if any(p.bias is not None for p in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
        return "biases other than q/k/v's"
    if cache is None:
        return None
    if cache.dim() != 5 or not cache.is_contiguous():
        return "a KV cache of another layout"
    if cache.dtype not in (torch.float32, torch.bfloat16):
        return f"a {cache.dtype} KV cache"
    return None


def _gguf_buckets(model: Any) -> frozenset[int] | None:
    """The row buckets (up to GGUF_MAX_TOKENS) where every GGUF projection of the layers
    runs what the fused call runs — the integer kernel on block parts, the float
    one on float parts — or None when no projection is GGUF."""
    gguf = [m for layer in model.layers for m in layer.modules() if isinstance(m, GGUFLinear)]
    if not gguf:
        return None

    def fused_there(layer: GGUFLinear, bucket: int) -> bool:
        kernel = layer.kernels[bucket]
        return kernel == "int" or (kernel == "float" and not set(layer.qtypes) & INT_TYPES)

    buckets = range(bucket_index(GGUF_MAX_TOKENS) + 1)
    return frozenset(b for b in buckets if all(fused_there(m, b) for m in gguf))


def _projection(linear: Any) -> Any:
    """A projection's weight for the plan: its buffer, or its GGUF parts."""
    if isinstance(linear, GGUFLinear):
        parts = zip(linear.parts(), linear.panels, strict=True)
        return [(qtype, raw.numpy(), panels) for (qtype, raw), panels in parts]
    return as_buffer(linear.weight.detach())


def _layer_buffers(layer: Any, cache: torch.Tensor) -> tuple[Any, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    bias = attn.qkv_proj.bias
    return (
        as_buffer(layer.input_layernorm.weight.detach()),
        _projection(attn.qkv_proj),
        None if bias is None else bias.detach().float().contiguous().numpy(),
        _projection(attn.o_proj),
        as_buffer(layer.post_attention_layernorm.weight.detach()),
        _projection(mlp.gate_up_proj),
        _projection(mlp.down_proj),
        as_buffer(cache),
    )
