"""Architecture name (config.json's `architectures[0]`) -> model class."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ModelLoadError
from asyncllm.models.llama import LlamaForCausalLM, Qwen2ForCausalLM

# Every supported family is a LlamaForCausalLM variant: one forward, one interface.
MODEL_REGISTRY: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def check_architecture(architectures: Any) -> str:
    """The first architecture named in a config if we support it, else ModelLoadError."""
    if not architectures:
        raise ModelLoadError(
            "config.json names no architecture (`architectures` is empty); supported: "
            + ", ".join(supported_architectures())
        )
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return str(arch)
    raise ModelLoadError(
        f"unsupported architecture {', '.join(map(str, architectures))}; supported: "
        + ", ".join(supported_architectures())
    )


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class that serves `hf_config`, or ModelLoadError naming what is supported."""
    return MODEL_REGISTRY[check_architecture(getattr(hf_config, "architectures", None))]
