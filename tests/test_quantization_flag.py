"""`EngineArgs.quantization` / `--quantization int8|int4` (vLLM's flag): a float
checkpoint's linear layers quantized at load into integer weights that stay small
in memory, with logits close to the float model's and mostly the same greedy
tokens; the combinations it cannot serve fail at once, naming why."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, EngineArgs, SamplingParams
from asyncllm.cli.args import add_engine_args, engine_args_from
from asyncllm.errors import ConfigError, ModelLoadError
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from asyncllm.models.quant.layers import QuantLinear
from asyncllm.models.quant.loader import group_for, quantize_weight
from quant_checkpoints import TINY_QUANT
from tiny_models import make_tiny_model

# asyncllm-tiny (trained on the Python standard library): a trained model, whose
# greedy choices are clear-cut, unlike a random one's near-uniform distributions
PROMPTS = [
    "def __init__(self, name, value=None):\n        self.",
    "import os\nimport sys\n\n\ndef main():\n    ",
    "    for key, value in sorted(items.items()):\n        if ",
    'class Error(Exception):\n    """Base class for ',
]
MAX_TOKENS = 16
# Per method: the largest |logprob difference| of a prompt token to the float model,
# and the least share of prompt positions where its first choice is the float
# model's. Measured: int8 0.028 and 52 / 52; int4 0.34 and 50 / 52.
TOLERANCE = {"int8": (0.1, 0.95), "int4": (1.0, 0.85)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("quant_flag"), **TINY_QUANT)


def _linear_bytes(model: torch.nn.Module) -> int:
    total = 0
    for path, module in model.named_modules():
        if not path.startswith("layers."):
            continue
        if isinstance(module, QuantLinear):
            total += module.weight_bytes()
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


@pytest.mark.parametrize("method,ratio", [("int8", 0.26), ("int4", 0.16)])
def test_linear_weights_are_integers_and_smaller(tiny: Path, method: str, ratio: float) -> None:
    cfg = load_hf_config(tiny)
    cpu = torch.device("cpu")
    base = load_model(tiny, cfg, torch.float32, cpu)
    model = load_model(tiny, cfg, torch.float32, cpu, quantization=method)
    layers = [m for p, m in model.named_modules() if p.startswith("layers.") and "proj" in p]
    assert layers and all(isinstance(m, QuantLinear) for m in layers)
    assert type(model.lm_head) is torch.nn.Linear  # the head stays float
    assert _linear_bytes(model) <= ratio * _linear_bytes(base)
    # round to nearest: each weight within half a step of its group's scale
    for path in ("layers.0.self_attn.qkv_proj", "layers.1.mlp.down_proj"):
        layer, weight = model.get_submodule(path), base.get_submodule(path).weight
        step = layer.scales.repeat_interleave(layer.group_size, dim=1)
        assert ((layer.dequantized() - weight).abs() <= step / 2 + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_layer_tiles_and_dtypes_equal_the_dequantized_matmul(bits: int) -> None:
    layer = quantize_weight(torch.randn(70, 96), bits, 32)
    x = torch.randn(3, 5, 96)
    want = x @ layer.dequantized().T
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    layer.tile_rows = 16  # five tiles, the last partial
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    got = layer(x.bfloat16())  # bf16 in, the weight tile cast to bf16, bf16 out
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.1)


def _run(
    model: str, quantization: str | None
) -> tuple[list[list[int]], list[list[float]], list[int]]:
    """Greedy continuations, each prompt token's logprob, and the model's first
    choice after each prompt position (its greedy token there, whatever came before)."""
    params = SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=1
    )
    with LLM(
        model=str(model), dtype="float32", max_model_len=256, quantization=quantization
    ) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    scores = [
        [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:], strict=True)]
        for o in outs
    ]
    firsts = [
        next(t for t, lp in pos.items() if lp.rank == 1)
        for o in outs
        for pos in o.prompt_logprobs[1:]
    ]
    return tokens, scores, firsts


def test_quantized_model_stays_close_to_the_float_model() -> None:
    tokens, scores, firsts = _run("asyncllm-tiny", None)
    for method, (max_diff, min_equal) in TOLERANCE.items():
        q_tokens, q_scores, q_firsts = _run("asyncllm-tiny", method)
        diffs = [
            abs(a - b)
            for s, q in zip(scores, q_scores, strict=True)
            for a, b in zip(s, q, strict=True)
        ]
        equal = sum(a == b for a, b in zip(firsts, q_firsts, strict=True))
        assert 0 < max(diffs) <= max_diff, (method, max(diffs))  # > 0: the weights changed
        assert equal >= min_equal * len(firsts), (method, equal, len(firsts))
        if method == "int8":  # so close that whole greedy continuations agree
            assert q_tokens == tokens


def test_the_flag_and_its_errors(tiny: Path, tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_args_from(parser.parse_args([str(tiny), "--quantization", "int4"])).quantization
    with pytest.raises(ConfigError, match="EngineArgs.quantization='fp8'.*int8, int4"):
        EngineArgs(model=str(tiny), quantization="fp8")
    with pytest.raises(ModelLoadError, match="layers.0.mlp.down_proj: int4 .* 191 is odd"):
        quantize_weight(torch.randn(8, 191), 4, 32, "layers.0.mlp.down_proj")
    # the group: the given size, else a smaller power-of-two fraction, else the row
    for cols, group in ((576, 64), (1536, 128), (40, 40)):
        assert group_for(cols, 128) == group
    # a row-parallel slice holds whole groups of the full row, or the load fails
    assert quantize_weight(torch.randn(8, 256), 8, 128, "x", shards=2).group_size == 128
    with pytest.raises(
        ModelLoadError, match="tensor_parallel_size=2 gives each rank 288 of its 576 inputs"
    ):
        quantize_weight(torch.randn(8, 288), 8, 128, "layers.0.mlp.down_proj", shards=2)
    # an already-quantized checkpoint is not quantized again
    quantized = tmp_path / "quantized"
    shutil.copytree(tiny, quantized)
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "config_groups": {}}
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="already quantized"):
        load_model(quantized, load_hf_config(quantized), torch.float32, torch.device("cpu"), "int8")


@pytest.mark.parametrize("method", ["int4"])  # int8: the same path, wider groups
def test_two_ranks_quantize_their_slices_as_one_rank_does(method: str) -> None:
    """Under tensor parallelism each rank quantizes its slice on group boundaries:
    the integers are the unsharded model's, so the tokens are one rank's."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    tokens = []
    for tp in (1, 2):
        llm = LLM(
            "asyncllm-tiny",
            multiprocess=False,
            dtype="float32",
            max_model_len=256,
            quantization=method,
            tensor_parallel_size=tp,
        )
        try:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        finally:
            if llm.engine.core is not None:
                llm.engine.core.close()  # stops the workers
            llm.shutdown()
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
    assert tokens[0] == tokens[1]
