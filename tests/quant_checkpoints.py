"""compressed-tensors checkpoints of tiny random models, written by the
`compressed-tensors` package itself (as llm-compressor does), for tests.

`write_compressed` quantizes every Linear of a tiny Llama but the LM head (the
scale and zero-point rule is compressed-tensors' own `calculate_qparams` over each
channel's or group's min / max), compresses and saves it; beside it, the same model
with each Linear's weight replaced by compressed-tensors' own decompression of the
checkpoint (the float reference the engine must match).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tiny_models import make_tiny_model

# hidden and intermediate sizes that groups of 128 divide
TINY_QUANT: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, head_dim=32)

SCHEMES: dict[str, dict[str, Any]] = {
    "w8a8": dict(bits=8, strategy="channel", act=True, format="int-quantized"),
    "w8a16": dict(bits=8, strategy="channel", act=False, format="int-quantized"),
    "w4a16_g32_sym": dict(bits=4, strategy="group", group=32, sym=True),
    "w4a16_g32_asym": dict(bits=4, strategy="group", group=32, sym=False),
    "w4a16_g128_sym": dict(bits=4, strategy="group", group=128, sym=True),
    "w4a16_g128_asym": dict(bits=4, strategy="group", group=128, sym=False),
}


def _scheme(name: str) -> tuple[Any, str]:
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    s = SCHEMES[name]
    weights = QuantizationArgs(
        num_bits=s["bits"],
        type="int",
        symmetric=s.get("sym", True),
        strategy=s["strategy"],
        group_size=s.get("group"),
    )
    inputs = None
    if s.get("act"):
        inputs = QuantizationArgs(
            num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True
        )
    scheme = QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs)
    return scheme, s.get("format", "pack-quantized")


def write_compressed(root: Path, name: str, seed: int = 0) -> tuple[Path, Path]:
    """(the compressed checkpoint, the float checkpoint of its dequantized weights)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(root / "float", seed=seed, **TINY_QUANT)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    scheme, fmt = _scheme(name)
    apply_quantization_config(
        model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"])
    )
    _calibrate_weights(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    out = root / name
    model.save_pretrained(out)
    compressor.update_config(str(out))
    reference = root / f"{name}-dequantized"
    _save_dequantized(src, out, reference, scheme, fmt)
    for folder in (out, reference):  # the tokenizer and generation config, as in `src`
        for file in src.iterdir():
            if file.name.startswith(("tokenizer", "special_tokens", "generation_config")):
                (folder / file.name).write_bytes(file.read_bytes())
    return out, reference


def _calibrate_weights(model: torch.nn.Module) -> None:
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.detach()
        args = module.quantization_scheme.weights
        if args.strategy == "channel":
            low, high = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            groups = w.view(w.shape[0], -1, args.group_size)
            low, high = groups.amin(2), groups.amax(2)
        scale, zero = calculate_qparams(low, high, args)
        module.weight_scale.data.copy_(scale.view_as(module.weight_scale))
        if hasattr(module, "weight_zero_point"):
            module.weight_zero_point.data.copy_(zero.view_as(module.weight_zero_point))


def _save_dequantized(src: Path, compressed: Path, out: Path, scheme: Any, fmt: str) -> None:
    """The float model whose Linear weights are compressed-tensors' decompression of
    the tensors saved in `compressed`."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    compressor = BaseCompressor.get_value_from_registry(fmt)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with safe_open(compressed / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        for name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear) or f"{name}.weight_scale" not in keys:
                continue
            state = {k[len(name) + 1 :]: f.get_tensor(k) for k in keys if k.startswith(name + ".")}
            state.pop("bias", None)
            weight = compressor.decompress(state, scheme)["weight"]
            module.weight.data.copy_(weight.float())
    model.save_pretrained(out)
