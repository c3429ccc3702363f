"""PEFT adapters for tests: written with the `peft` package itself from random
initialisation, with B made non-zero (PEFT starts B at zero, which would make every
adapter the base model), and transformers + peft's own greedy output as the reference;
`AdapterCase`, a tiny model with its adapters and references, as the LoRA tests share.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncllm import LLM, LoRARequest

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    seed: int,
    r: int = 8,
    alpha: float = 16.0,
    targets: tuple[str, ...] = ALL_TARGETS,
    use_rslora: bool = False,
    scale: float = 0.2,
) -> Path:
    """Write a PEFT LoRA adapter of the model at `model_dir` to `out_dir`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=list(targets),
        use_rslora=use_rslora,
        lora_dropout=0.0,
        init_lora_weights=True,
    )
    model: Any = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: list[list[int]], max_tokens: int
) -> list[list[int]]:
    """transformers + peft's greedy continuation (the base model's when
    `adapter_dir` is None)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiny_models import hf_greedy

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir)
    return hf_greedy(model_dir, prompts, max_tokens, model=model)


class AdapterCase:
    """A tiny model (`tiny_models.make_tiny_model(arch, **config)`), one adapter per
    entry of `adapters` (`make_adapter`'s keywords; seeds from `seed` up, adapter i
    served as `loras[i]`, LoRA id i + 1) and transformers + peft's greedy outputs
    of `prompts`: the base model's (`base_ref`) and each adapter's (`refs[i]`)."""

    def __init__(
        self,
        root: Path,
        arch: str,
        config: dict[str, Any],
        adapters: list[dict[str, Any]],
        *,
        seed: int,
        prompts: list[list[int]],
        max_tokens: int,
    ) -> None:
        from tiny_models import make_tiny_model

        self.model_dir = make_tiny_model(root / "model", arch, **config)
        self.loras = []
        for i, kw in enumerate(adapters):
            path = make_adapter(self.model_dir, root / f"adapter{i}", seed=seed + i, **kw)
            self.loras.append(LoRARequest(f"adapter{i}", i + 1, str(path)))
        self.base_ref = peft_greedy(self.model_dir, None, prompts, max_tokens)
        self.refs = [
            peft_greedy(self.model_dir, Path(lora.lora_path), prompts, max_tokens)
            for lora in self.loras
        ]

    def llm(self, **engine_args: Any) -> LLM:
        """An in-process float32 engine on the model with LoRA on (rank up to 16)
        and `engine_args` (max_loras, tensor_parallel_size, ...)."""
        args = dict(enable_lora=True, max_lora_rank=16) | engine_args
        return LLM(str(self.model_dir), multiprocess=False, dtype="float32", **args)
