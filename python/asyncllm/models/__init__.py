"""Models: the registry, config and weight loading, and the Llama family over a paged
KV cache (see `attention` for the cache layout and the per-step metadata)."""

from asyncllm.models.attention import AttentionMetadata, build_attention_metadata
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from asyncllm.models.registry import get_model_class, supported_architectures

__all__ = [
    "AttentionMetadata",
    "build_attention_metadata",
    "get_model_class",
    "load_hf_config",
    "load_model",
    "supported_architectures",
]
