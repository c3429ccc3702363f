"""Building a model's modules without paying for weights that a checkpoint will
overwrite: the class that serves a config, and a context in which parameters are
allocated but never initialised. Shared by the safetensors and the GGUF loaders."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from asyncllm.models.llama import LlamaForCausalLM
from asyncllm.models.registry import model_location

_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "xavier_uniform_",
    "xavier_normal_",
    "trunc_normal_",
    "zeros_",
    "ones_",
    "constant_",
)


def get_model_class(hf_config: Any) -> type[LlamaForCausalLM]:
    """The class that serves `hf_config`, or ModelLoadError naming what is supported."""
    module, name = model_location(hf_config)
    return getattr(importlib.import_module(f"asyncllm.models.{module}"), name)  # type: ignore[no-any-return]


@contextmanager
def uninitialised(dtype: torch.dtype, device: torch.device) -> Iterator[None]:
    """Build modules straight on `device` in `dtype` with their parameters left
    uninitialised, since the checkpoint overwrites every one of them. (The meta
    device would do the same, but its first use imports torch's compiler stack,
    which costs seconds of start-up.)"""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    old_dtype = torch.get_default_dtype()
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        torch.set_default_dtype(dtype)
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old_dtype)
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)
