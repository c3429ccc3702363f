"""Loading a prepared GGUF model with its quantized weights kept quantized.

The model is built as for a safetensors checkpoint (parameters allocated, never
initialised); then every `nn.Linear` whose GGUF tensors are quantized is replaced
by a `GGUFLinear` over their blocks, a quantized embedding by a `GGUFEmbedding`,
and the remaining float tensors (norms, biases, F32 weights) are copied into the
parameters. The float weights of the replaced layers are freed without ever being
written, so resident memory is about the GGUF's size. The model files do not know
the encoding: the kernel selection at load (`worker.linear_select`) leaves the GGUF
layers alone, and `model.logits_head` is set to the quantized LM head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ModelLoadError
from asyncllm.models.construct import get_model_class, uninitialised
from asyncllm.models.gguf.layers import GGUFEmbedding, GGUFLinear
from asyncllm.models.gguf.tensors import GGUFTensors
from asyncllm.models.llama import LlamaForCausalLM

_FLOAT_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _stays_quantized(qtype: str, dtype: torch.dtype) -> bool:
    """Blocks stay blocks; float tensors become parameters (in `dtype`) unless
    that would make them larger (an F16 weight in a float32 model)."""
    if qtype not in _FLOAT_TYPES:
        return True
    return _FLOAT_TYPES[qtype].itemsize < dtype.itemsize


def load_gguf_model(
    model_dir: str | Path, hf_config: Any, dtype: torch.dtype, device: torch.device
) -> LlamaForCausalLM:
    """The GGUF model prepared in `model_dir`, in eval mode; ModelLoadError names an
    unsupported tensor type, a missing tensor or a shape the config contradicts."""
    tensors = GGUFTensors(model_dir, hf_config)
    with uninitialised(dtype, device):
        model = get_model_class(hf_config)(hf_config)
    if model.tp is not None:
        raise ModelLoadError(
            "tensor parallelism over GGUF weights is not supported yet; use "
            "EngineArgs.tensor_parallel_size=1"
        )
    model.init_buffers()  # type: ignore[operator]  # (reads the embedding's dtype: before it is replaced)
    sources: dict[str, list[str]] = model.weight_sources()  # type: ignore[operator]
    with torch.no_grad():
        done = _quantized_linears(model, tensors, sources, dtype, device)
        done |= _quantized_embedding(model, tensors, sources, dtype, device)
        for name, param in model.named_parameters():
            if name in done:
                continue
            parts = [tensors.float(src) for src in sources[name]]
            tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            if tensor.shape != param.shape:
                raise ModelLoadError(
                    f"GGUF tensor {', '.join(sources[name])} has shape {tuple(tensor.shape)}, "
                    f"the config implies {tuple(param.shape)}"
                )
            param.copy_(tensor)
    embed = model.embed_tokens
    if model.lm_head is None and isinstance(embed, GGUFEmbedding):
        embed.pack_panels()  # the tied head's kernel reads the panel layout
        model.logits_head = embed.as_linear()
    elif isinstance(model.lm_head, GGUFLinear):
        model.logits_head = model.lm_head
    if isinstance(model.logits_head, GGUFLinear):
        model.logits_head.out_dtype = torch.float32  # the logits as computed
    return model.eval()


def _quantized_linears(
    model: nn.Module,
    tensors: GGUFTensors,
    sources: dict[str, list[str]],
    dtype: torch.dtype,
    device: torch.device,
) -> set[str]:
    """Replace the linear layers whose weights are quantized; their parameter names."""
    done: set[str] = set()
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        srcs = sources[f"{path}.weight"]
        qtypes = [tensors.qtype(src) for src in srcs]
        if not any(_stays_quantized(q, dtype) for q in qtypes):
            continue
        parts: list[tuple[str, torch.Tensor]] = []
        for qtype, src in zip(qtypes, srcs, strict=True):
            raw = tensors.raw(src).to(device)
            if parts and parts[-1][0] == qtype:  # fused parts of one type: one block matrix
                parts[-1] = (qtype, torch.cat((parts[-1][1], raw)))
            else:
                parts.append((qtype, raw))
        bias = None
        if module.bias is not None:
            bias = torch.cat([tensors.float(s) for s in sources[f"{path}.bias"]]).to(device, dtype)
        layer = GGUFLinear(parts, module.in_features, bias)
        layer.pack_panels()
        if layer.out_features != module.out_features:
            raise ModelLoadError(
                f"GGUF tensors {', '.join(srcs)} have {layer.out_features} rows, the config "
                f"implies {module.out_features}"
            )
        model.set_submodule(path, layer)
        done |= {f"{path}.weight", f"{path}.bias"}
    return done


def _quantized_embedding(
    model: nn.Module,
    tensors: GGUFTensors,
    sources: dict[str, list[str]],
    dtype: torch.dtype,
    device: torch.device,
) -> set[str]:
    embed = model.embed_tokens
    if not isinstance(embed, nn.Embedding):
        return set()
    (src,) = sources["embed_tokens.weight"]
    qtype = tensors.qtype(src)
    if not _stays_quantized(qtype, dtype):
        return set()
    raw = tensors.raw(src).to(device)
    if raw.shape[0] != embed.num_embeddings:
        raise ModelLoadError(
            f"GGUF tensor {src} has {raw.shape[0]} rows, the config implies {embed.num_embeddings}"
        )
    model.embed_tokens = GGUFEmbedding(qtype, raw, embed.embedding_dim, dtype)
    return {"embed_tokens.weight"}
