"""LoRA serving against transformers + peft: every adapter's greedy output equals
peft's (alone, merged, and in one batch that mixes 8 adapters with base rows) for
three small configs; adapters that do not fit are refused by name while the engine
keeps serving; the scheduler keeps to max_loras."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lora_adapters import AdapterCase, make_adapter

from asyncllm import LoRARequest, SamplingParams
from asyncllm.errors import ConfigError, InvalidRequestError
from tiny_models import make_tiny_model

MAX_TOKENS = 8
PROMPTS = [[1, 306, 4966, 304, 1074, 278], [1, 450, 4996, 17354], [1, 15043, 29892, 590, 1024]]
# Three small configs: Llama with grouped-query attention, Qwen2 (q/k/v biases) and a
# Llama with plain multi-head attention, other widths and three layers.
CONFIGS = {
    "llama-gqa": dict(arch="llama"),
    "qwen2": dict(arch="qwen2"),
    "llama-mha": dict(
        arch="llama",
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=3,
        num_key_value_heads=3,
        head_dim=32,
    ),
}
# Eight adapters: ranks 4..16, alpha, rsLoRA, and subsets of the targets.
ADAPTERS = [
    dict(r=8),
    dict(r=16, alpha=8.0),
    dict(r=4, targets=("q_proj", "v_proj")),
    dict(r=16, use_rslora=True),
    dict(r=8, targets=("gate_proj", "up_proj", "down_proj")),
    dict(r=2, alpha=4.0, targets=("k_proj", "o_proj")),
    dict(r=12, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    dict(r=8, alpha=32.0, targets=("up_proj", "down_proj", "v_proj")),
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> AdapterCase:
    """A tiny model of one config, its eight adapters and peft's greedy outputs."""
    cfg = dict(CONFIGS[request.param])
    arch = str(cfg.pop("arch"))
    root = tmp_path_factory.mktemp(request.param)
    return AdapterCase(root, arch, cfg, ADAPTERS, seed=100, prompts=PROMPTS, max_tokens=MAX_TOKENS)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def test_adapters_differ_from_the_base(case: AdapterCase) -> None:
    """The references themselves: an adapter that changed nothing would test nothing."""
    assert all(ref != case.base_ref for ref in case.refs)


def test_each_adapter_alone_equals_peft(case: AdapterCase) -> None:
    llm = case.llm(max_loras=8)
    try:
        for lora, ref in zip(case.loras, case.refs, strict=True):
            assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)) == ref, lora
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == case.base_ref
    finally:
        llm.shutdown()


@pytest.mark.parametrize("max_loras", [8, 3])
def test_a_batch_mixing_eight_adapters_and_base_rows(case: AdapterCase, max_loras: int) -> None:
    """Every prompt under every adapter and the base model, in one generate call:
    with max_loras=3 the scheduler holds requests back until a slot frees."""
    prompts, loras, expected = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for a in [None, *range(len(case.loras)), None]:
            prompts.append(prompt)
            loras.append(None if a is None else case.loras[a])
            expected.append(case.base_ref[p] if a is None else case.refs[a][p])
    llm = case.llm(max_loras=max_loras)
    try:
        assert _tokens(llm.generate(prompts, GREEDY, lora_request=loras)) == expected
        slots = llm.engine.core.runner.lora.slots
        assert max_loras == 8 or slots.num_loads > max_loras  # slots were rewritten
    finally:
        llm.shutdown()


def test_merged_adapter_equals(case: AdapterCase, tmp_path: Path) -> None:
    """peft's merge_and_unload of one adapter, saved as a plain model, gives the same
    tokens as serving the adapter over the base."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tiny_models import hf_greedy

    base = AutoModelForCausalLM.from_pretrained(case.model_dir)
    merged = PeftModel.from_pretrained(base, case.loras[1].lora_path).merge_and_unload()
    assert hf_greedy(case.model_dir, PROMPTS, MAX_TOKENS, model=merged) == case.refs[1]


def _rewrite_config(src: Path, dst: Path, **changes: object) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return dst


def _rename_module(src: Path, dst: Path) -> Path:
    """A copy of an adapter whose layer-0 q_proj is named x_proj: a module the
    model does not have."""
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
    tensors = load_file(src / "adapter_model.safetensors")
    renamed = {
        k.replace("layers.0.self_attn.q_proj", "layers.0.self_attn.x_proj"): v
        for k, v in tensors.items()
    }
    save_file(renamed, dst / "adapter_model.safetensors")
    return dst


def test_adapters_that_do_not_fit_are_refused_and_the_engine_serves_on(
    case: AdapterCase, tmp_path: Path
) -> None:
    big = make_adapter(case.model_dir, tmp_path / "big", seed=1, r=32)
    other = make_tiny_model(tmp_path / "other", "llama", hidden_size=32, head_dim=8)
    wrong_shape = make_adapter(other, tmp_path / "wrong_shape", seed=2, r=4)
    renamed = _rename_module(Path(case.loras[0].lora_path), tmp_path / "renamed")
    dora = _rewrite_config(Path(case.loras[0].lora_path), tmp_path / "dora", use_dora=True)
    llm = case.llm(max_loras=8)
    bad = [
        (big, "r=32 is above EngineArgs.max_lora_rank=16"),
        (wrong_shape, "do not fit the layer"),
        (renamed, "'model.layers.0.self_attn.x_proj' is not one this model adapts"),
        (dora, "use_dora=True is not supported"),
        (tmp_path / "missing", "expected adapter_config.json and adapter_model.safetensors"),
    ]
    try:
        for i, (path, message) in enumerate(bad):
            lora = LoRARequest(f"bad{i}", 50 + i, str(path))
            with pytest.raises(InvalidRequestError, match=message):
                llm.generate(PROMPTS[:1], GREEDY, lora_request=lora)
        assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=case.loras[0])) == case.refs[0]
    finally:
        llm.shutdown()


def test_request_fields_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="lora_int_id=0 is invalid"):
        LoRARequest("a", 0, "/x")
    with pytest.raises(InvalidRequestError, match="lora_name=.* 1 to 256 characters"):
        LoRARequest("a" * 300, 1, "/x")
    with pytest.raises(InvalidRequestError, match="lora_path"):
        LoRARequest("a", 1, "")


def test_engine_args_limits() -> None:
    from asyncllm import EngineArgs

    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineArgs(enable_lora=True, max_lora_rank=0)
    with pytest.raises(ConfigError, match="max_cpu_loras=1 is invalid: must be >= max_loras"):
        EngineArgs(enable_lora=True, max_loras=2, max_cpu_loras=1)
