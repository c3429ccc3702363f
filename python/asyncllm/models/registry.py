"""Architecture name (config.json's `architectures[0]`) -> model class.

Names are checked without importing torch, so the front end and a null-executor
engine core can validate a model directory cheaply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from asyncllm.errors import ModelLoadError

if TYPE_CHECKING:
    from asyncllm.models.llama import LlamaForCausalLM

# Every supported family is a LlamaForCausalLM variant: one forward, one interface.
_ARCHITECTURES = {
    "LlamaForCausalLM": "LlamaForCausalLM",
    "MistralForCausalLM": "LlamaForCausalLM",
    "Qwen2ForCausalLM": "Qwen2ForCausalLM",
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


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class that serves `hf_config`, or ModelLoadError naming what is supported."""
    from asyncllm.models import llama

    name = _ARCHITECTURES[check_architecture(getattr(hf_config, "architectures", None))]
    return getattr(llama, name)  # type: ignore[no-any-return]
