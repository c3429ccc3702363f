"""Write a compressed-tensors checkpoint (what llm-compressor writes and vLLM loads)
of a float Hugging Face model, with the `compressed-tensors` package itself: every
Linear but the LM head quantized round to nearest (the package's own
`calculate_qparams` over each channel's or group's min / max: no calibration data),
compressed and saved. The tests (tests/quant_checkpoints.py) and
benches/bench_quant.py use it; `pip install 'asyncllm[compressed-tensors]'`.

    python tools/compressed_checkpoint.py FLOAT_DIR OUT_DIR --scheme w4a16_g128_sym
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import torch

SCHEMES: dict[str, dict[str, Any]] = {
    "w8a8": dict(bits=8, strategy="channel", act=True, format="int-quantized"),
    "w8a16": dict(bits=8, strategy="channel", act=False, format="int-quantized"),
    "w4a16_g32_sym": dict(bits=4, strategy="group", group=32, sym=True),
    "w4a16_g32_asym": dict(bits=4, strategy="group", group=32, sym=False),
    "w4a16_g128_sym": dict(bits=4, strategy="group", group=128, sym=True),
    "w4a16_g128_asym": dict(bits=4, strategy="group", group=128, sym=False),
}
# Files copied from the float model beside the weights and config.
_COPIED = ("tokenizer", "special_tokens", "generation_config", "chat_template")


def scheme(name: str) -> tuple[Any, str]:
    """(the compressed-tensors QuantizationScheme, its compression format)."""
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
    return (
        QuantizationScheme(targets=["Linear"], weights=weights, input_activations=inputs),
        s.get("format", "pack-quantized"),
    )


def write_compressed(src: Path, out: Path, name: str) -> Path:
    """The compressed checkpoint of float model `src` under scheme `name`, in `out`."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
    quant_scheme, fmt = scheme(name)
    config = QuantizationConfig(config_groups={"group_0": quant_scheme}, ignore=["lm_head"])
    apply_quantization_config(model, config)
    calibrate_weights(model)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    copy_extras(src, out)
    return out


def calibrate_weights(model: torch.nn.Module) -> None:
    """Each quantized module's weight scale (and zero point) from its weight's range."""
    from compressed_tensors.quantization.utils import calculate_qparams

    for module in model.modules():
        if not hasattr(module, "weight_scale"):
            continue
        w = module.weight.detach().float()
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


def copy_extras(src: Path, out: Path) -> None:
    for file in src.iterdir():
        if file.is_file() and file.name.startswith(_COPIED):
            shutil.copy(file, out / file.name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="float Hugging Face model directory")
    ap.add_argument("out", type=Path, help="where to write the compressed checkpoint")
    ap.add_argument("--scheme", choices=list(SCHEMES), default="w4a16_g128_sym")
    args = ap.parse_args()
    print(write_compressed(args.src, args.out, args.scheme))


if __name__ == "__main__":
    main()
