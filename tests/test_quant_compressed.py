"""compressed-tensors checkpoints (W8A8 int8, W8A16, W4A16 pack-quantized with groups
of 32 and 128, symmetric and asymmetric), written by the compressed-tensors package
from tiny random models: their weights stay integers in memory, dequantize to what
compressed-tensors' own decompression gives, and the model continues prompts as
transformers does on those dequantized weights (for W8A8, with each linear layer's
input quantized per token as vLLM's int8 kernels do)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from asyncllm import LLM, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from asyncllm.models.parallel_layers import Shard
from asyncllm.models.quant.compressed import _slice
from asyncllm.models.quant.layers import QuantLinear, quantize_rows_int8
from quant_checkpoints import SCHEMES, write_compressed
from tiny_models import hf_greedy

pytest.importorskip("compressed_tensors")

PROMPTS = [[1, 450, 4996, 17354, 1701], [1, 15043, 29892, 590, 1024, 338], [1, 306, 763]]
MAX_TOKENS = 12
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("compressed")
    return {name: write_compressed(root / name, name) for name in SCHEMES}


@pytest.mark.parametrize("name", list(SCHEMES))
def test_weights_stay_integers_and_dequantize_as_compressed_tensors(
    checkpoints: dict[str, tuple[Path, Path]], name: str
) -> None:
    compressed, reference = checkpoints[name]
    model = load_model(compressed, load_hf_config(compressed), torch.float32, CPU)
    layer = model.layers[1].mlp.gate_up_proj
    assert isinstance(layer, QuantLinear)
    assert layer.bits == SCHEMES[name]["bits"] and layer.act_quant == SCHEMES[name].get(
        "act", False
    )
    assert (layer.zeros is None) == SCHEMES[name].get("sym", True)
    assert layer.qweight.dtype == (torch.int8 if layer.bits == 8 else torch.uint8)
    floats = 4 * layer.out_features * layer.in_features
    assert layer.weight_bytes() < floats * (0.3 if layer.bits == 8 else 0.2)
    assert type(model.lm_head) is torch.nn.Linear  # ignored by the recipe: float
    with safe_open(reference / "model.safetensors", framework="pt") as f:
        for path, parts in (
            ("layers.1.mlp.gate_up_proj", ("gate", "up")),
            ("layers.0.self_attn.qkv_proj", ("q", "k", "v")),
        ):
            base = "model." + path.rsplit(".", 1)[0]
            want = torch.cat([f.get_tensor(f"{base}.{p}_proj.weight") for p in parts])
            torch.testing.assert_close(
                model.get_submodule(path).dequantized(), want, rtol=0, atol=0
            )


@pytest.mark.parametrize("name", ["w4a16_g32_asym", "w4a16_g128_sym", "w8a16"])
def test_weight_only_layer_equals_dequantized_matmul(
    checkpoints: dict[str, tuple[Path, Path]], name: str
) -> None:
    compressed, _ = checkpoints[name]
    model = load_model(compressed, load_hf_config(compressed), torch.float32, CPU)
    layer = model.layers[0].mlp.down_proj
    x = torch.randn(7, layer.in_features)
    want = x @ layer.dequantized().T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_w8a8_layer_is_vllm_int8_arithmetic(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    """Per-token scale absmax / 127, inputs rounded half to even and saturated, the
    integer dot products exact, then both scales: checked against int64 sums."""
    compressed, _ = checkpoints["w8a8"]
    model = load_model(compressed, load_hf_config(compressed), torch.float32, CPU)
    layer = model.layers[0].self_attn.qkv_proj
    x = torch.randn(40, layer.in_features) * torch.logspace(-3, 2, 40)[:, None]
    x[3] = 0.0  # an all-zero row: scale 0, output 0 (+ bias)
    absmax = x.abs().amax(dim=1)
    q = torch.round(x * (127.0 / absmax.clamp_min(1e-30))[:, None]).clamp(-128, 127)
    assert torch.equal(quantize_rows_int8(x)[0], q.to(torch.int8))
    exact = q.long() @ layer.qweight.long().T
    want = exact.double() * (absmax / 127.0).double()[:, None] * layer.scales[:, 0].double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-6, atol=1e-7)
    assert torch.equal(layer(x)[3], torch.zeros(layer.out_features))


def _vllm_input_quant(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> tuple:
    """A transformers Linear's input as vLLM's W8A8 kernels see it: quantized per
    token to int8 and scaled back (x_q * s; the output is then x_q * s · Wᵀ)."""
    (x,) = args
    rows = x.reshape(-1, x.shape[-1]).float()
    scale = rows.abs().amax(dim=1, keepdim=True) / 127.0
    q = torch.round(rows / torch.where(scale > 0, scale, 1.0)).clamp(-128, 127)
    return ((q * scale).view(x.shape).to(x.dtype),)


# every scheme's weights are checked above; the engine end to end on one of each kind
@pytest.mark.parametrize("name", ["w8a8", "w4a16_g32_asym", "w4a16_g128_sym"])
def test_greedy_and_logprobs_equal_transformers_on_the_dequantized_weights(
    checkpoints: dict[str, tuple[Path, Path]], name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reference path (weight-only layers as GGUF blocks round x to int8 on
    the integer kernel: test_quant_as_gguf.py): tokens equal; every prompt
    token's logprob equal to float rounding."""
    monkeypatch.setenv("ASYNCLLM_QUANT_KERNEL", "reference")
    from transformers import AutoModelForCausalLM

    compressed, reference = checkpoints[name]
    hf = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    if SCHEMES[name].get("act"):
        for module_name, module in hf.named_modules():
            if isinstance(module, torch.nn.Linear) and module_name != "lm_head":
                module.register_forward_pre_hook(_vllm_input_quant)
    want = hf_greedy(reference, PROMPTS, MAX_TOKENS, model=hf)
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=0
    )
    with LLM(model=str(compressed), dtype="float32", max_model_len=256) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == want
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0, :-1].float()
        ref = torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
        pairs = zip(out.prompt_logprobs[1:], prompt[1:], strict=True)
        got = torch.tensor([lp[t].logprob for lp, t in pairs])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)


def test_two_ranks_hold_whole_groups_and_give_one_ranks_tokens(
    checkpoints: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tensor parallelism over a W4A16 checkpoint (asymmetric, groups of 32): each
    rank keeps its rows or whole groups of its input columns, with their scales and
    zero points; the tokens are one rank's (both on the reference path: row-parallel
    slices stay there)."""
    monkeypatch.setenv("ASYNCLLM_QUANT_KERNEL", "reference")
    compressed, _ = checkpoints["w4a16_g32_asym"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    tokens = []
    for tp in (1, 2):
        llm = LLM(
            str(compressed),
            multiprocess=False,
            dtype="float32",
            max_model_len=256,
            tensor_parallel_size=tp,
        )
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            if llm.engine.core is not None:
                llm.engine.core.close()  # stops the workers
            llm.shutdown()
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert tokens[0] == tokens[1]
    # a rank's columns that would split a group: an error naming the module
    part = (torch.zeros(8, 32, dtype=torch.uint8), torch.ones(8, 2), None, 64)
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj: .* groups of 32"):
        _slice(part, Shard("w", 1, 16, 48), 4, "model.layers.0.mlp.down_proj")


def test_unsupported_schemes_are_named(checkpoints: dict[str, tuple[Path, Path]]) -> None:
    import json

    compressed, _ = checkpoints["w8a8"]
    config = json.loads((compressed / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    group["input_activations"]["dynamic"] = False  # static activation scales
    (compressed / "config.json").write_text(json.dumps(config))
    try:
        with pytest.raises(ModelLoadError, match="input_activations.*not supported"):
            load_model(compressed, load_hf_config(compressed), torch.float32, CPU)
        config["quantization_config"]["quant_method"] = "gptq"
        (compressed / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError, match="quant_method='gptq'"):
            load_model(compressed, load_hf_config(compressed), torch.float32, CPU)
    finally:
        group["input_activations"]["dynamic"] = True
        config["quantization_config"]["quant_method"] = "compressed-tensors"
        (compressed / "config.json").write_text(json.dumps(config))
