"""Tiny random-weight Hugging Face models with real tokenizers, for tests.

`make_tiny_model` writes a complete local model directory (config.json, safetensors
weights, tokenizer files) that both transformers and asyncllm load; the same seed
gives the same weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from conftest import tokenizer_dir

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
)

TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    # Wider than the default 0.02 so that greedy choices are clear-cut, not near-ties
    # that rounding could flip between two correct implementations.
    initializer_range=0.1,
)


def make_tiny_model(
    model_dir: str | Path,
    arch: str = "llama",
    tokenizer: str = "llama-2",
    seed: int = 0,
    max_shard_size: str | int | None = None,
    **config_overrides: Any,
) -> Path:
    """Write a tiny `arch` ("llama" or "qwen2") model using the `tokenizer` assets to
    `model_dir` and return its path. `max_shard_size` (e.g. "100KB") makes a sharded
    checkpoint with an index; `config_overrides` go to the transformers config."""
    path = Path(model_dir)
    path.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_dir(tokenizer)
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, path / name)

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    settings = dict(TINY_DEFAULTS, vocab_size=tok.get_vocab_size(with_added_tokens=True))
    settings.update(_special_token_ids(tok, tok_dir))
    settings.update(config_overrides)
    if arch == "llama":
        config: Any = LlamaConfig(**settings)
        model_cls: Any = LlamaForCausalLM
    elif arch == "qwen2":
        config = Qwen2Config(**settings)
        model_cls = Qwen2ForCausalLM
    else:
        raise ValueError(f"arch {arch!r}: expected 'llama' or 'qwen2'")

    torch.manual_seed(seed)
    model = model_cls(config).eval()
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    if (tok_dir / "generation_config.json").is_file():  # save_pretrained wrote its own
        shutil.copy(tok_dir / "generation_config.json", path / "generation_config.json")
    return path


def make_tiny_qwen(model_dir: str | Path, **config_overrides: Any) -> Path:
    """A tiny random-weight Qwen2 with the qwen2.5 tokenizer and chat template, as
    the API tests serve it (hidden 32 and tied embeddings keep its 151k vocabulary
    small)."""
    kw: dict[str, Any] = {"hidden_size": 32, "tie_word_embeddings": True, **config_overrides}
    return make_tiny_model(model_dir, arch="qwen2", tokenizer="qwen2.5", **kw)


def _special_token_ids(tok: Tokenizer, tok_dir: Path) -> dict[str, int]:
    """bos/eos/pad ids named in tokenizer_config.json, so generation stops where the
    real model would."""
    file = tok_dir / "tokenizer_config.json"
    if not file.is_file():
        return {}
    cfg = json.loads(file.read_text())
    ids: dict[str, int] = {}
    for key in ("bos_token", "eos_token", "pad_token"):
        token = cfg.get(key)
        if isinstance(token, dict):
            token = token.get("content")
        token_id = tok.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids[f"{key}_id"] = token_id
    return ids


def hf_greedy(
    model_dir: Path,
    prompts: list[list[int]],
    max_tokens: int,
    model: torch.nn.Module | None = None,
) -> list[list[int]]:
    """transformers' own greedy continuation of each prompt, exactly `max_tokens`
    long (EOS ignored): the reference the engine's tokens must equal. `model`: one
    already loaded (e.g. with a reference attention), else float32 from `model_dir`."""
    from transformers import AutoModelForCausalLM

    if model is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf: Any = model.eval()  # a transformers model: `generate` is its own
    out = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            out.append(gen[0, len(prompt) :].tolist())
    return out
