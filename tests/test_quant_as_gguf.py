"""Int8 and int4 checkpoint layers on the GGUF kernels (`models.quant.as_gguf`):
their weights as GGUF blocks bit for bit, the layers that cannot be left on the
reference path with the reason, and the engine running a quantized model on the
integer kernel and the fused decode step, close to the reference path (and equal
to it on the float kernel)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.default_model import DEFAULT_MODEL
from asyncllm.models.gguf.dequant import dequantize
from asyncllm.models.gguf.layers import GGUFLinear
from asyncllm.models.quant.as_gguf import as_gguf_linears, gguf_blocks, why_not
from asyncllm.models.quant.layers import QuantLinear, pack_int4
from asyncllm.models.quant.loader import quantize_weight

PROMPTS = [[1, 450, 4996, 1735, 1701], [1, 1504, 2989, 590, 1024, 338], [1, 306, 763]]


@pytest.mark.parametrize("bits,group,qtype", [(8, 128, "Q8_0"), (4, 32, "Q4_0"), (4, 64, "Q4_0")])
def test_symmetric_weights_become_blocks_bit_for_bit(bits: int, group: int, qtype: str) -> None:
    """`--quantization`'s layers (f16 scales): the blocks hold the very weights."""
    layer = quantize_weight(
        torch.randn(48, 256, generator=torch.Generator().manual_seed(0)), bits, group
    )
    assert why_not(layer) is None
    got_type, raw = gguf_blocks(layer)
    assert got_type == qtype
    assert torch.equal(dequantize(raw, qtype), layer.dequantized())


def test_zero_points_and_float32_scales_move_weights_by_f16_rounding() -> None:
    """Q4_1 for int4 with zero points (its offset rounded to f16), and float32
    scales rounded to f16: each weight within 2^-10 of its group's scale times
    its distance from zero, far inside a quantization step."""
    gen = torch.Generator().manual_seed(1)
    q = torch.randint(-8, 8, (32, 256), dtype=torch.int8, generator=gen)
    scales = torch.rand(32, 4, generator=gen) * 0.1 + 1e-3  # float32, groups of 64
    zeros = torch.randint(-4, 4, (32, 4), dtype=torch.int8, generator=gen)
    for zero in (None, zeros):
        layer = QuantLinear(pack_int4(q), 4, scales, zero, 256)
        assert why_not(layer) is None
        qtype, raw = gguf_blocks(layer)
        assert qtype == ("Q4_0" if zero is None else "Q4_1")
        want = layer.dequantized()
        bound = scales.repeat_interleave(64, dim=1) * 24 * 2.0**-10
        assert ((dequantize(raw, qtype) - want).abs() <= bound).all()


def test_layers_without_an_exact_form_stay_and_say_why() -> None:
    q8 = torch.zeros(16, 64, dtype=torch.int8)
    cases = {
        "zero points": QuantLinear(
            q8, 8, torch.ones(16, 1), torch.zeros(16, 1, dtype=torch.int8), 64
        ),
        "no multiple of 32": QuantLinear(q8, 8, torch.ones(16, 4), None, 64),
        "f16's range": QuantLinear(q8, 8, torch.full((16, 1), 1e6), None, 64),
    }
    model = torch.nn.Sequential(*cases.values())
    for words, layer in cases.items():
        reason = why_not(layer)
        assert reason is not None and words in reason, reason
    assert as_gguf_linears(model) == 0
    assert all(isinstance(m, QuantLinear) for m in model)


def _run(monkeypatch: pytest.MonkeyPatch, quant: str, method: str) -> tuple[list, list, Any]:
    """Greedy tokens, prompt logprobs and the model of asyncllm-tiny quantized by
    `method`, with ASYNCLLM_QUANT_KERNEL=`quant`."""
    monkeypatch.setenv("ASYNCLLM_QUANT_KERNEL", quant)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0)
    with LLM(
        model=DEFAULT_MODEL,
        dtype="float32",
        max_model_len=256,
        quantization=method,
        multiprocess=False,
    ) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        model = llm.engine.core.runner.model
    logprobs = [
        [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
        for o, p in zip(outs, PROMPTS, strict=True)
    ]
    return [list(o.outputs[0].token_ids) for o in outs], logprobs, model


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_on_the_float_kernel_the_engine_equals_the_reference(
    monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """With the GGUF layers' float kernel (dequantize + fp32) the converted model is
    the reference model: same tokens, logprobs to float rounding."""
    monkeypatch.setenv("ASYNCLLM_GGUF_KERNEL", "float")
    tokens, logprobs, model = _run(monkeypatch, "auto", method)
    assert any(isinstance(m, GGUFLinear) for m in model.modules())
    ref_tokens, ref_logprobs, ref_model = _run(monkeypatch, "reference", method)
    assert not any(isinstance(m, GGUFLinear) for m in ref_model.modules())
    assert tokens == ref_tokens
    for got, want in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_decode_runs_fused_on_the_integer_kernel_close_to_the_reference(
    monkeypatch: pytest.MonkeyPatch, fused_calls: list[int], method: str
) -> None:
    """The default: every decoder projection a GGUFLinear, decode steps in the fused
    call, prompt logprobs within the integer kernel's rounding of x (int8 per 16
    inputs) of the reference path's."""
    _, logprobs, model = _run(monkeypatch, "auto", method)
    projections = [m for p, m in model.named_modules() if p.startswith("layers.") and "proj" in p]
    assert projections and all(type(m) is GGUFLinear for m in projections)
    assert fused_calls, "no step ran fused"
    _, ref_logprobs, _ = _run(monkeypatch, "reference", method)
    for got, want in zip(logprobs, ref_logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0.15)


@pytest.mark.parametrize("name", ["w8a8", "w4a16_g32_asym", "w8a16"])
def test_compressed_checkpoints_run_the_gguf_kernels_close_to_the_reference(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """llm-compressor's checkpoints (float32 scales, rounded to f16; W8A8's inputs
    then round per 16 values, not per token): GGUF layers, prompt logprobs within
    the integer kernel's rounding of the reference path's (vLLM's arithmetic)."""
    pytest.importorskip("compressed_tensors")
    from quant_checkpoints import write_compressed

    compressed, _ = write_compressed(tmp_path / name, name)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=0)
    results = []
    for quant in ("auto", "reference"):
        monkeypatch.setenv("ASYNCLLM_QUANT_KERNEL", quant)
        with LLM(
            model=str(compressed), dtype="float32", max_model_len=256, multiprocess=False
        ) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            layers = list(llm.engine.core.runner.model.modules())
        assert any(type(m) is GGUFLinear for m in layers) == (quant == "auto")
        results.append(
            [
                [lp[t].logprob for lp, t in zip(o.prompt_logprobs[1:], p[1:], strict=True)]
                for o, p in zip(outs, PROMPTS, strict=True)
            ]
        )
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=0.15)
