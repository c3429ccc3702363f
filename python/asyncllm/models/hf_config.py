"""Reading a model directory's config.json, with errors that say what is wrong.

The config is read with `json`, not transformers: importing transformers costs
seconds of engine start-up, and only the fields below are used. Fields a
config.json leaves out take the defaults of the matching transformers config
class, so a config means the same here as it does there.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from asyncllm.errors import ModelLoadError
from asyncllm.models.registry import check_architecture

_COMMON: dict[str, Any] = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": None,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_parameters": None,
    "attention_bias": False,
    "sliding_window": None,
    "use_sliding_window": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "torch_dtype": None,
    "dtype": None,
}
# Per architecture, what its transformers config class defaults differently.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"bos_token_id": 1, "eos_token_id": 2},
    "MistralForCausalLM": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "sliding_window": 4096,
        "use_sliding_window": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2ForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "Qwen3ForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 22016,
        "max_position_embeddings": 32768,
        "head_dim": 128,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "Phi3ForCausalLM": {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "use_sliding_window": True,  # Phi-3 applies `sliding_window` whenever it is set
        "bos_token_id": 1,
        "eos_token_id": 32000,
    },
    "MixtralForCausalLM": {
        "intermediate_size": 14336,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e6,
        "use_sliding_window": True,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
    "Qwen2MoeForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 5632,
        "max_position_embeddings": 32768,
        "qkv_bias": True,
        "num_experts": 60,
        "num_local_experts": None,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "sliding_window": 4096,
        "use_sliding_window": False,
        "max_window_layers": 28,
    },
    "Qwen3MoeForCausalLM": {
        "vocab_size": 151936,
        "intermediate_size": 6144,
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_local_experts": None,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "sliding_window": 4096,
        "use_sliding_window": False,
    },
    "Gemma2ForCausalLM": {
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 2,  # when `layer_types` is absent
        "final_logit_softcapping": 30.0,
        "attn_logit_softcapping": 50.0,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
    "Gemma3ForCausalLM": {
        "vocab_size": 262208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072,
        "tie_word_embeddings": True,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
        "rope_theta": 1e6,
        "rope_local_base_freq": 10000.0,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "bos_token_id": 2,
        "eos_token_id": 1,
    },
}


def load_hf_config(model_dir: str | Path) -> SimpleNamespace:
    """The config of a local model directory, as attributes.

    The directory, config.json and the architecture are checked first, so the user
    sees which of them is wrong.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object")
    arch = check_architecture(raw.get("architectures"))
    values = {**_COMMON, **_DEFAULTS[arch], **raw}
    if values["num_key_value_heads"] is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(values[key], int) or values[key] < 1:
            raise ModelLoadError(f"{config_file}: {key}={values[key]!r} must be a positive int")
    return SimpleNamespace(**values)


def layer_windows(cfg: Any) -> list[int | None]:
    """Each layer's sliding window (None: global attention), as transformers reads
    the config: `layer_types` where given, else Mistral's, Mixtral's and Qwen3-MoE's
    `sliding_window` on every layer, Qwen2's and Qwen3's `use_sliding_window` from
    layer `max_window_layers` on, and Qwen2-MoE's on every other layer (the 1st,
    3rd, ...) below `max_window_layers`."""
    num_layers = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or window <= 0:
        return [None] * num_layers
    types = getattr(cfg, "layer_types", None)
    if types:
        return [window if t == "sliding_attention" else None for t in types]
    pattern = getattr(cfg, "sliding_window_pattern", None)
    if isinstance(pattern, int) and pattern > 0:  # Gemma configs without layer_types
        return [window if (i + 1) % pattern else None for i in range(num_layers)]
    if not getattr(cfg, "use_sliding_window", True):
        return [None] * num_layers
    arch = str(getattr(cfg, "architectures", None) or "")
    limit = getattr(cfg, "max_window_layers", None)
    if "Qwen2Moe" in arch:
        limit = num_layers if limit is None else limit
        return [window if i % 2 == 0 and i < limit else None for i in range(num_layers)]
    if limit is None or any(name in arch for name in ("Mistral", "Mixtral", "Qwen3Moe")):
        limit = 0
    return [window if i >= limit else None for i in range(num_layers)]


def kv_window(hf_config: Any) -> int | None:
    """The window past which no layer reads a KV block again, when every layer is a
    sliding-window one (the KV-cache manager then frees blocks that left it); None
    when any layer attends globally: it needs every block to the end."""
    windows = layer_windows(hf_config)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def longrope_original(hf_config: Any) -> int | None:
    """With `longrope` scaling (Phi-3), `original_max_position_embeddings`: a sequence
    whose prompt is longer rotates with the long factors from its first token on
    (transformers picks the factors by a forward's length), so its K/V differ from
    a shorter prompt's and must not be shared through the prefix cache. None
    without longrope."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    if not isinstance(params, dict):
        return None
    if (params.get("rope_type") or params.get("type")) != "longrope":
        return None
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    return int(original or hf_config.max_position_embeddings)
