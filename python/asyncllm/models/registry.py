"""Architecture name (config.json's `architectures[0]`) -> model class.

Names are checked without importing torch, so the front end and a null-executor
engine core can validate a model directory cheaply.
"""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ModelLoadError

# Architecture -> (module under asyncllm.models, class). Every class is a
# LlamaForCausalLM variant: one forward, one interface for the runner.
_ARCHITECTURES = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen_moe", "Qwen3MoeForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def check_architecture(architectures: Any) -> str:
    """The first architecture named in a config if we support it, else ModelLoadError."""
    if not architectures:
        raise ModelLoadError(
            "config.json names no architecture (`architectures` is empty); supported: "
            + ", ".join(supported_architectures())
        )
    for arch in architectures:
        if arch in _ARCHITECTURES:
            return str(arch)
    raise ModelLoadError(
        f"unsupported architecture {', '.join(map(str, architectures))}; supported: "
        + ", ".join(supported_architectures())
    )


def model_location(hf_config: Any) -> tuple[str, str]:
    """(module under asyncllm.models, class name) that serves `hf_config`, or
    ModelLoadError naming what is supported. The loader imports it: this table
    imports no model, so the model files may read it."""
    return _ARCHITECTURES[check_architecture(getattr(hf_config, "architectures", None))]
