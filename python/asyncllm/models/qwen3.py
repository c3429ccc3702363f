"""Qwen3: Llama with an RMSNorm over each head of q and of k before the rotation
(and no q/k/v bias unless the config asks for it)."""

from __future__ import annotations

from asyncllm.models.layers import RMSNorm
from asyncllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models (0.6B to 32B)."""

    qk_norm = RMSNorm
