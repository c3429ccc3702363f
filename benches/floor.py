"""The floor: a bare decode step of the same weights in plain torch with a
contiguous KV cache — no scheduler, no paging, no engine — plus greedy argmax."""

from __future__ import annotations

import time
from statistics import median

import torch
import torch.nn.functional as F


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    var = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(var + eps) * w


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@torch.inference_mode()
def time_floor_decode(model_dir: str, batch: int, context: int, repeats: int = 10) -> float:
    """Median seconds of one decode step for `batch` sequences at `context` tokens."""
    import glob

    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model_dir)
    sd: dict[str, torch.Tensor] = {}
    for f in glob.glob(f"{model_dir}/*.safetensors"):
        sd.update(load_file(f))
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
    L = cfg.num_hidden_layers
    eps = cfg.rms_norm_eps
    layers = []
    for i in range(L):
        p = f"model.layers.{i}."
        qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).contiguous()
        gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
        layers.append(
            (
                sd[p + "input_layernorm.weight"],
                qkv,
                sd[p + "self_attn.o_proj.weight"],
                sd[p + "post_attention_layernorm.weight"],
                gate_up.contiguous(),
                sd[p + "mlp.down_proj.weight"],
            )
        )
    embed = sd["model.embed_tokens.weight"]
    lm_head = sd.get("lm_head.weight", embed)
    norm = sd["model.norm.weight"]
    k_cache = [torch.randn(batch, Hkv, context + 1, D) for _ in range(L)]
    v_cache = [torch.randn(batch, Hkv, context + 1, D) for _ in range(L)]
    from asyncllm.models.layers import rope_inv_freq, rope_parameters

    inv = rope_inv_freq(D, rope_parameters(cfg))
    freqs = context * inv
    cos = torch.cat([freqs.cos(), freqs.cos()]).view(1, 1, 1, D)
    sin = torch.cat([freqs.sin(), freqs.sin()]).view(1, 1, 1, D)
    ids = torch.randint(0, cfg.vocab_size, (batch,))
    inter = cfg.intermediate_size

    def step() -> torch.Tensor:
        x = embed[ids]
        for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(layers):
            h = _rms(x, ln1, eps) @ qkv.t()
            q, k, v = h.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = _rope(q.view(batch, H, 1, D), cos, sin)
            k = _rope(k.view(batch, Hkv, 1, D), cos, sin)
            k_cache[i][:, :, context : context + 1] = k
            v_cache[i][:, :, context : context + 1] = v.view(batch, Hkv, 1, D)
            a = F.scaled_dot_product_attention(q, k_cache[i], v_cache[i], enable_gqa=True)
            x = x + a.reshape(batch, H * D) @ o.t()
            g, u = (_rms(x, ln2, eps) @ gate_up.t()).split([inter, inter], dim=-1)
            x = x + (F.silu(g) * u) @ down.t()
        logits = _rms(x, norm, eps) @ lm_head.t()
        return logits.argmax(-1).cpu()

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return median(times)
