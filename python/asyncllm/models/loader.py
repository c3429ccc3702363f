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
from asyncllm.gguf_files import is_prepared
from asyncllm.models.construct import get_model_class, uninitialised
from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.parallel_layers import Shard, weight_shards
from asyncllm.models.quant.compressed import compressed_config
from asyncllm.models.quant.loader import quantize_linears, replace_compressed_linears

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def load_model(
    model_dir: str | Path,
    hf_config: Any,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
) -> LlamaForCausalLM:
    """The model of `model_dir` with its weights in `dtype` on `device`, in eval mode.
    Quantized weights (GGUF blocks, compressed-tensors integers) stay quantized;
    `quantization` ("int8", "int4") quantizes a float checkpoint's linear layers.

    Raises ModelLoadError naming the missing weight file or tensor, or the
    quantization that cannot apply.
    """
    path = Path(model_dir)
    qc = compressed_config(hf_config)
    if quantization is not None and (qc is not None or is_prepared(path)):
        raise ModelLoadError(
            f"quantization={quantization!r} quantizes float checkpoints; {path} is already "
            "quantized (GGUF or compressed-tensors): leave quantization unset"
        )
    if is_prepared(path):  # a GGUF model: its weights stay in their blocks
        from asyncllm.models.gguf.loader import load_gguf_model

        return load_gguf_model(path, hf_config, dtype, device)
    model_cls = get_model_class(hf_config)
    locations = _tensor_locations(path)
    with uninitialised(dtype, device):
        model = model_cls(hf_config)
    sources: dict[str, list[str]] = model.weight_sources()  # type: ignore[operator]

    with ExitStack() as stack, torch.no_grad():
        handles: dict[str, Any] = {}

        def read(name: str) -> torch.Tensor:
            file = locations.get(name)
            if file is None:
                raise ModelLoadError(f"tensor {name!r} is missing from the checkpoint in {path}")
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(path / file, framework="pt"))
            return handles[file].get_tensor(name)

        if qc is not None:  # integer weights into QuantLinear layers, before the floats
            replace_compressed_linears(model, qc, sources, read, locations.__contains__)
        params = dict(model.named_parameters())
        if model.tp is not None:  # tensor parallelism: this rank's slices only
            _load_shards(model, params, sources, handles, stack, locations, path)
            model.init_buffers()  # type: ignore[operator]
            if quantization is not None:
                quantize_linears(model, quantization)
            return model.eval()
        for name, param in params.items():
            parts = [read(src) for src in sources[name]]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            # Stacked experts: per-expert [rows, cols] tensors make [E, rows', cols].
            if (
                tensor.shape != param.shape
                and param.dim() == 3
                and len(parts) > 1
                and tensor.numel() == param.numel()
                and tensor.shape[-1] == param.shape[-1]
            ):
                tensor = tensor.view(param.shape)
            if tensor.shape != param.shape:
                raise ModelLoadError(
                    f"tensor {', '.join(sources[name])} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(param.shape)}"
                )
            param.copy_(tensor)
    model.init_buffers()  # type: ignore[operator]
    if quantization is not None:
        quantize_linears(model, quantization)
    return model.eval()


def _load_shards(
    model: LlamaForCausalLM,
    params: dict[str, torch.nn.Parameter],
    sources: dict[str, list[str]],
    handles: dict[str, Any],
    stack: ExitStack,
    locations: dict[str, str],
    path: Path,
) -> None:
    """Fill a tensor-parallel rank's parameters from the slices it owns
    (`safe_open(...).get_slice`: only those bytes are read). Vocabulary rows
    past the end of the vocabulary (the last rank's padding) are zero."""
    assert model.tp is not None

    def read(shard: Shard) -> torch.Tensor:
        file = locations.get(shard.source)
        if file is None:
            raise ModelLoadError(
                f"tensor {shard.source!r} is missing from the checkpoint in {path}"
            )
        if file not in handles:
            handles[file] = stack.enter_context(safe_open(path / file, framework="pt"))
        tensor = handles[file].get_slice(shard.source)
        if shard.dim is None:
            return tensor[:]  # type: ignore[no-any-return]
        if shard.dim == 0:
            return tensor[shard.start : shard.stop]  # type: ignore[no-any-return]
        return tensor[:, shard.start : shard.stop]  # type: ignore[no-any-return]

    for name, param in params.items():
        shards = weight_shards(name, sources[name], model.tp, model.head_dim, model.vocab_size)
        parts = [read(shard) for shard in shards]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        rows = tensor.shape[0] if tensor.dim() else 0
        padded = tensor.shape[1:] == param.shape[1:] and rows < param.shape[0]
        if name.split(".")[0] in ("embed_tokens", "lm_head") and padded:
            param.zero_()
            param[:rows].copy_(tensor)
            continue
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"tensor {', '.join(sources[name])} (rank {model.tp.rank}'s slice) has shape "
                f"{tuple(tensor.shape)}, the config implies {tuple(param.shape)}"
            )
        param.copy_(tensor)


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
