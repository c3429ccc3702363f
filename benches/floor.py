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


class FloorDecode:
    """One decode step for `batch` sequences at `context` tokens, nothing else."""

    def __init__(self, model_dir: str, batch: int, context: int) -> None:
        import glob

        from safetensors.torch import load_file
        from transformers import AutoConfig

        from asyncllm.models.layers import rope_inv_freq, rope_parameters

        cfg = AutoConfig.from_pretrained(model_dir)
        sd: dict[str, torch.Tensor] = {}
        for f in glob.glob(f"{model_dir}/*.safetensors"):
            sd.update(load_file(f))
        self.H, self.Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.D = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.H
        self.eps = cfg.rms_norm_eps
        self.inter = cfg.intermediate_size
        self.batch, self.context = batch, context
        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([sd[p + f"self_attn.{n}_proj.weight"] for n in "qkv"])
            gate_up = torch.cat([sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"]])
            self.layers.append(
                (
                    sd[p + "input_layernorm.weight"],
                    qkv.contiguous(),
                    sd[p + "self_attn.o_proj.weight"],
                    sd[p + "post_attention_layernorm.weight"],
                    gate_up.contiguous(),
                    sd[p + "mlp.down_proj.weight"],
                )
            )
        self.embed = sd["model.embed_tokens.weight"]
        self.lm_head = sd.get("lm_head.weight", self.embed)
        self.norm = sd["model.norm.weight"]
        shape = (batch, self.Hkv, context + 1, self.D)
        self.k_cache = [torch.randn(shape) for _ in self.layers]
        self.v_cache = [torch.randn(shape) for _ in self.layers]
        freqs = context * rope_inv_freq(self.D, rope_parameters(cfg))
        self.cos = torch.cat([freqs.cos(), freqs.cos()]).view(1, 1, 1, self.D)
        self.sin = torch.cat([freqs.sin(), freqs.sin()]).view(1, 1, 1, self.D)
        self.ids = torch.randint(0, cfg.vocab_size, (batch,))

    @torch.inference_mode()
    def step(self) -> list[int]:
        B, H, Hkv, D, ctx = self.batch, self.H, self.Hkv, self.D, self.context
        x = self.embed[self.ids]
        for i, (ln1, qkv, o, ln2, gate_up, down) in enumerate(self.layers):
            h = _rms(x, ln1, self.eps) @ qkv.t()
            q, k, v = h.split([H * D, Hkv * D, Hkv * D], dim=-1)
            q = _rope(q.view(B, H, 1, D), self.cos, self.sin)
            k = _rope(k.view(B, Hkv, 1, D), self.cos, self.sin)
            self.k_cache[i][:, :, ctx : ctx + 1] = k
            self.v_cache[i][:, :, ctx : ctx + 1] = v.view(B, Hkv, 1, D)
            a = F.scaled_dot_product_attention(
                q, self.k_cache[i], self.v_cache[i], enable_gqa=Hkv != H
            )
            x = x + a.reshape(B, H * D) @ o.t()
            g, u = (_rms(x, ln2, self.eps) @ gate_up.t()).split([self.inter, self.inter], dim=-1)
            x = x + (F.silu(g) * u) @ down.t()
        logits = (_rms(x, self.norm, self.eps) @ self.lm_head.t()).float()
        return logits.argmax(-1).tolist()


def time_floor_decode(model_dir: str, batch: int, context: int, repeats: int = 10) -> float:
    """Median seconds of one floor decode step."""
    floor = FloorDecode(model_dir, batch, context)
    floor.step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        floor.step()
        times.append(time.perf_counter() - t0)
    return median(times)
