"""A Hugging Face config (config.json's fields) from a GGUF file's metadata.

llama.cpp's converter writes each family's hyperparameters under its architecture
name (`llama.block_count`, `qwen3.attention.key_length`, ...); the table below maps
them back to the config fields that transformers' GGUF loader gives the same
families, so a GGUF means here what it means there. An architecture not listed, or
a feature whose metadata we cannot express (rope scaling other than linear,
per-frequency rope factors), is a ModelLoadError naming it: a model that would
load but compute something else is worse than one that does not load.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ModelLoadError

# GGUF `general.architecture` -> the Hugging Face architecture we serve it as.
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}

# `{arch}.<key>` -> config field, for every family.
_KEYS = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "attention.key_length": "head_dim",
    "vocab_size": "vocab_size",
    "attention.sliding_window": "sliding_window",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}

# Tensors that carry rope scaling we do not implement from GGUF (Llama 3.1's
# frequency factors, Phi-3's longrope factors).
_UNSUPPORTED_TENSORS = (
    "rope_freqs.weight",
    "rope_factors_long.weight",
    "rope_factors_short.weight",
)


def hf_config_from_metadata(fields: dict[str, Any], tensor_names: set[str]) -> dict[str, Any]:
    """config.json's content for a GGUF with metadata `fields` (key -> value) and
    the tensors `tensor_names`."""
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"GGUF architecture {arch!r} is not supported; supported: "
            + ", ".join(sorted(ARCHITECTURES))
        )
    config: dict[str, Any] = {"architectures": [ARCHITECTURES[arch]], "model_type": arch}
    for key, field in _KEYS.items():
        if f"{arch}.{key}" in fields:
            config[field] = fields[f"{arch}.{key}"]
    if "vocab_size" not in config:
        config["vocab_size"] = len(fields.get("tokenizer.ggml.tokens", ()))
    if arch == "llama" and "head_dim" not in config and f"{arch}.rope.dimension_count" in fields:
        config["head_dim"] = fields[f"{arch}.rope.dimension_count"]
    if arch == "phi3" and "head_dim" not in config:
        head_dim = config["hidden_size"] // config["num_attention_heads"]
        rotary = fields.get(f"{arch}.rope.dimension_count", head_dim)
        config["partial_rotary_factor"] = rotary / head_dim
    if arch in ("gemma2", "gemma3"):
        config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
        config["query_pre_attn_scalar"] = config["head_dim"]
    config["tie_word_embeddings"] = "output.weight" not in tensor_names
    for token in ("bos", "eos", "pad"):
        if f"tokenizer.ggml.{token}_token_id" in fields:
            config[f"{token}_token_id"] = fields[f"tokenizer.ggml.{token}_token_id"]
    scaling = _rope_scaling(fields, arch)
    if scaling is not None:
        config["rope_scaling"] = scaling
    for name in _UNSUPPORTED_TENSORS:
        if name in tensor_names:
            raise ModelLoadError(
                f"GGUF tensor {name!r} (per-frequency rope scaling) is not supported yet"
            )
    return config


def _rope_scaling(fields: dict[str, Any], arch: str) -> dict[str, Any] | None:
    kind = fields.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(fields[f"{arch}.rope.scaling.factor"])}
    raise ModelLoadError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported; only linear")
