"""Loading safetensors weights (one file, or shards listed in an index) into a model.

The module is built on the meta device (no memory, no random init), materialized
empty on the target device, then filled tensor by tensor from the checkpoint, so
loading costs one read of the weights and nothing else.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from asyncllm.errors import ModelLoadError
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.registry import get_model_class

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The model of `model_dir` with its weights in `dtype` on `device`, in eval mode.

    Raises ModelLoadError naming the missing weight file or tensor.
    """
    path = Path(model_dir)
    model_cls = get_model_class(hf_config)
    locations = _tensor_locations(path)
    with torch.device("meta"):
        model = model_cls(hf_config)
    model = model.to(dtype).to_empty(device=device)  # the cast is free on meta
    sources: dict[str, list[str]] = model.weight_sources()  # type: ignore[operator]
    params = dict(model.named_parameters())

    with ExitStack() as stack, torch.no_grad():
        handles: dict[str, Any] = {}

        def read(name: str) -> torch.Tensor:
            file = locations.get(name)
            if file is None:
                raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint in {path}")
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(path / file, framework="pt"))
            return handles[file].get_tensor(name)

        for name, param in params.items():
            parts = [read(src) for src in sources[name]]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.shape != param.shape:
                raise ModelLoadError(
                    f"tensor {', '.join(sources[name])} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(param.shape)}"
                )
            param.copy_(tensor)
    model.init_buffers()  # type: ignore[operator]
    return model.eval()


def _tensor_locations(path: Path) -> dict[str, str]:
    """Tensor name -> the file (relative to `path`) that holds it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"cannot read the weight map of {index}: {e}") from e
        for file in sorted(set(weight_map.values())):
            if not (path / file).is_file():
                raise ModelLoadError(f"weight file {file!r} listed in {index} is missing")
        return {str(k): str(v) for k, v in weight_map.items()}
    single = path / SINGLE_FILE
    if not single.is_file():
        raise ModelLoadError(
            f"no weights in {path}: expected {SINGLE_FILE} or {INDEX_FILE} (safetensors)"
        )
    with safe_open(single, framework="pt") as f:
        return {name: SINGLE_FILE for name in f.keys()}  # noqa: SIM118 - not a dict
