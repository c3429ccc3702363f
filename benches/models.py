"""Random-weight benchmark models built from transformers configs (no downloads)."""

from __future__ import annotations

import os
import shutil
import tempfile
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
    # A 1B-shaped Llama (TinyLlama's widths, 16 layers where it has 22): hidden 2048, 32
    # heads (dim 64), 8 KV heads, intermediate 5632, vocab 32000; 0.85 B parameters
    # (3.4 GB in fp32)
    "llama1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        head_dim=64,
        num_key_value_heads=8,
        intermediate_size=5632,
    ),
    # llama1b's --quick stand-in: hidden 256, 2 layers, 4 heads (dim 64), 2 KV heads,
    # intermediate 512, vocab 32000 (its rows still whole Q4_K blocks of 256)
    "llama1b-quick": dict(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=64,
        num_key_value_heads=2,
        intermediate_size=512,
    ),
    # Mixtral-style mixture of experts: hidden 256, 4 layers, 8 heads (dim 32), 4 KV
    # heads, 8 experts of intermediate 512 with 2 active per token, vocab 32000
    "moe": dict(
        arch="mixtral",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        head_dim=32,
        num_key_value_heads=4,
        intermediate_size=512,
        num_local_experts=8,
        num_experts_per_tok=2,
    ),
}


QUICK_HELP = "the smallest settings, a few seconds: checks that it runs (CI); figures mean nothing"


def build_model(
    name: str, root: str | Path, seed: int = 0, dtype: torch.dtype = torch.float32
) -> Path:
    """Save a random-weight Llama with the llama-2 tokenizer under root/name, its
    weights in `dtype` (root may be a str: bench_engine_overhead passes one through a
    child's command line)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    tokenizer_dir = ASSETS / "tokenizers" / "llama-2"
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"tokenizer assets not found at {tokenizer_dir} (set ASYNCLLM_ASSETS)")
    out = Path(root) / name
    if (out / "config.json").is_file():
        return out
    settings = dict(MODELS[name])
    mixtral = settings.pop("arch", "llama") == "mixtral"
    config_cls, model_cls = (
        (MixtralConfig, MixtralForCausalLM) if mixtral else (LlamaConfig, LlamaForCausalLM)
    )
    config = config_cls(
        vocab_size=32000,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        **settings,
    )
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype)  # type: ignore[arg-type]  # (transformers types .to oddly)
    # Written beside, then renamed: an interrupted build leaves no half model behind
    # that a later run would take for a finished one.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # as a plain mkdir would have made it
        model.save_pretrained(tmp)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (tokenizer_dir / f).is_file():
                shutil.copy(tokenizer_dir / f, tmp / f)
        os.replace(tmp, out)
    except OSError:
        if not (out / "config.json").is_file():  # not another process winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
