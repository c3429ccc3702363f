"""LoRA on a GGUF base (issue 31): SmolLM2-135M-Instruct's Q4_1 file takes a PEFT
adapter. On the reference kernel (float activations, the path held to
transformers) its greedy tokens equal transformers + peft on the same file's
weights; on the default integer kernel the adapter changes the output and gives
the same tokens alone and in a batch mixed with base rows."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncllm import LLM, LoRARequest, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _reference_tools() -> Any:
    spec = importlib.util.spec_from_file_location(
        "smollm2_reference", ROOT / "tools" / "smollm2_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def adapter_and_reference(
    smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[list[int]], list[list[int]]]:
    """A rank-8 adapter on every projection (random, B non-zero), written by peft
    over transformers' model of the file; the prompts' ids and peft's greedy tokens."""
    from peft import LoraConfig, get_peft_model

    tok, model = _reference_tools().reference_model(smollm2_gguf)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)
    peft_model: Any = get_peft_model(model, config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    out = tmp_path_factory.mktemp("smollm2_lora")
    peft_model.save_pretrained(out)
    ids = [tok(p)["input_ids"] for p in PROMPTS]
    want = []
    with torch.no_grad():
        for prompt in ids:
            x = torch.tensor([prompt])
            y = peft_model.generate(x, max_new_tokens=MAX_TOKENS, do_sample=False)
            want.append(y[0, len(prompt) :].tolist())
    return out, ids, want


def _llm(path: Path) -> LLM:
    return LLM(
        model=str(path), dtype="float32", max_model_len=256, enable_lora=True, max_lora_rank=8
    )


def test_the_reference_kernel_equals_peft(
    smollm2_gguf: Path, adapter_and_reference: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter, ids, want = adapter_and_reference
    monkeypatch.setenv("ASYNCLLM_GGUF_KERNEL", "float")
    with _llm(smollm2_gguf) as llm:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in ids],
            GREEDY,
            lora_request=LoRARequest("a", 1, str(adapter)),
            use_tqdm=False,
        )
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_the_integer_kernel_takes_the_adapter_alone_and_mixed(
    smollm2_gguf: Path, adapter_and_reference: Any
) -> None:
    adapter, ids, _ = adapter_and_reference
    lora = LoRARequest("a", 1, str(adapter))
    prompts = [{"prompt_token_ids": p} for p in ids]
    with _llm(smollm2_gguf) as llm:
        base = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        alone = llm.generate(prompts, GREEDY, lora_request=lora, use_tqdm=False)
        alone_ids = [list(o.outputs[0].token_ids) for o in alone]
        mixed = llm.generate(
            prompts * 2, GREEDY, lora_request=[lora] * 2 + [None] * 2, use_tqdm=False
        )
    assert alone_ids != base
    assert [list(o.outputs[0].token_ids) for o in mixed] == alone_ids + base
