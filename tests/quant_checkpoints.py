"""compressed-tensors checkpoints of tiny random models, written by the
`compressed-tensors` package itself (tools/compressed_checkpoint.py), for tests.

`write_compressed` writes a tiny Llama, its compressed checkpoint under a scheme,
and beside them the same model with each Linear's weight replaced by
compressed-tensors' own decompression of the checkpoint: the float reference the
engine must match.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from tiny_models import make_tiny_model

# hidden and intermediate sizes that groups of 128 divide
TINY_QUANT: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, head_dim=32)


def _tool() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "tools" / "compressed_checkpoint.py"
    spec = importlib.util.spec_from_file_location("compressed_checkpoint", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tool = _tool()
SCHEMES: dict[str, dict[str, Any]] = tool.SCHEMES


def write_compressed(root: Path, name: str, seed: int = 0) -> tuple[Path, Path]:
    """(the compressed checkpoint, the float checkpoint of its dequantized weights)."""
    pytest.importorskip("compressed_tensors")
    src = make_tiny_model(root / "float", seed=seed, **TINY_QUANT)
    out = tool.write_compressed(src, root / name, name)
    reference = root / f"{name}-dequantized"
    _save_dequantized(src, out, reference, name)
    tool.copy_extras(src, reference)
    return out, reference


def _save_dequantized(src: Path, compressed: Path, out: Path, name: str) -> None:
    """The float model whose Linear weights are compressed-tensors' decompression of
    the tensors saved in `compressed`."""
    from compressed_tensors.compressors import BaseCompressor
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    scheme, fmt = tool.scheme(name)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    with safe_open(compressed / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
        for module_name, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if f"{module_name}.weight_scale" not in keys:
                continue
            prefix = module_name + "."
            state = {k[len(prefix) :]: f.get_tensor(k) for k in keys if k.startswith(prefix)}
            state.pop("bias", None)
            weight = compressor.decompress(state, scheme)["weight"]
            module.weight.data.copy_(weight.float())
    model.save_pretrained(out)
