"""Random-weight benchmark models built from transformers configs (no downloads)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

ASSETS = Path(
    os.environ.get("ASYNCLLM_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets")
)

MODELS = {
    # hidden 64, 2 layers, 4 heads of dim 32, 2 KV heads, intermediate 128, vocab 32000
    "micro": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
    # hidden 512, 8 layers, 8 heads (dim 64), 4 KV heads, intermediate 1536, vocab 32000
    "small": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        head_dim=64,
        num_key_value_heads=4,
        intermediate_size=1536,
    ),
}


def build_model(name: str, root: Path, seed: int = 0) -> Path:
    """Save a random-weight Llama with the llama-2 tokenizer under root/name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_dir = ASSETS / "tokenizers" / "llama-2"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"tokenizer assets not found at {tokenizer_dir} (set ASYNCLLM_ASSETS)")
    out = root / name
    if (out / "config.json").is_file():
        return out
    config = LlamaConfig(
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **MODELS[name],
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / f).is_file():
            shutil.copy(tokenizer_dir / f, out / f)
    return out
