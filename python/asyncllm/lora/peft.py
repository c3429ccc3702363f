"""Reading an adapter in PEFT's format: adapter_config.json + adapter_model.safetensors.

Why a reader of our own: peft itself needs the base model in memory as a transformers
module; the engine needs only each target module's two matrices and the scale PEFT
applies (`lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`), which is
folded into B once, when the adapter is laid out for the slots (`lora.layers`).

Everything the adapter file claims is checked against what the engine can hold:
its rank against `max_lora_rank`, its tensors' shapes against each other. Features
PEFT has and we do not serve (DoRA, bias training, modules_to_save, per-module
rank or alpha patterns) are refused by name, never silently ignored.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from asyncllm.errors import InvalidRequestError
from asyncllm.lora.safetensors_file import read_tensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
# PEFT's key: base_model.model.<module path>.lora_{A,B}.weight
_PREFIX = "base_model.model."


@dataclass(frozen=True, slots=True)
class AdapterTensors:
    """An adapter's matrices by the Hugging Face module path they adapt
    ("model.layers.0.self_attn.q_proj"): (A [r, in], B [out, r]) in float32 on
    the host, and the `scale` of B."""

    rank: int
    scale: float
    modules: dict[str, tuple[torch.Tensor, torch.Tensor]]
    identity: str  # the weight file's path, size and mtime: a reload sees new files


def read_adapter(path: str, max_rank: int) -> AdapterTensors:
    """Read and check the adapter at `path`. Raises InvalidRequestError naming the
    file, the field and the limit."""
    root = Path(path)
    config_file, weights_file = root / CONFIG_FILE, root / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise InvalidRequestError(
            f"LoRA adapter {path!r}: expected {CONFIG_FILE} and {WEIGHTS_FILE} in that directory"
        )
    rank, alpha, rslora = _read_config(config_file, max_rank)
    scale = alpha / math.sqrt(rank) if rslora else alpha / rank
    modules = _pair_tensors(read_tensors(weights_file), weights_file, rank)
    stat = os.stat(weights_file)
    identity = f"{os.path.realpath(weights_file)}\0{stat.st_size}\0{stat.st_mtime_ns}"
    return AdapterTensors(rank, scale, modules, identity)


def _read_config(file: Path, max_rank: int) -> tuple[int, float, bool]:
    """(r, lora_alpha, use_rslora) of adapter_config.json, refusing what we do not serve."""
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidRequestError(f"{file}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"{file}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise InvalidRequestError(f"{file}: expected a JSON object")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise InvalidRequestError(f"{file}: r={rank!r} must be a positive integer")
    if rank > max_rank:
        raise InvalidRequestError(
            f"{file}: r={rank} is above EngineArgs.max_lora_rank={max_rank}; "
            "start the engine with a larger max_lora_rank"
        )
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise InvalidRequestError(f"{file}: lora_alpha={alpha!r} must be a finite number")
    for key, off in (("use_dora", False), ("bias", "none"), ("fan_in_fan_out", False)):
        if cfg.get(key, off) not in (off, None):
            raise InvalidRequestError(f"{file}: {key}={cfg[key]!r} is not supported ({off!r} is)")
    for key in ("modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform"):
        if cfg.get(key):
            raise InvalidRequestError(f"{file}: {key} is not supported (must be empty)")
    return rank, float(alpha), bool(cfg.get("use_rslora", False))


def _pair_tensors(
    tensors: dict[str, torch.Tensor], file: Path, rank: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Module path -> (A, B) in float32, every key and shape checked."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, _, which = key.removesuffix(".weight").rpartition(".")
        if not key.startswith(_PREFIX) or which not in ("lora_A", "lora_B"):
            raise InvalidRequestError(
                f"{file}: tensor {key!r} is not a LoRA matrix (expected "
                f"{_PREFIX}<module>.lora_A.weight / .lora_B.weight)"
            )
        halves.setdefault(stem.removeprefix(_PREFIX), {})[which] = tensor
    modules = {}
    for module, pair in halves.items():
        a, b = pair.get("lora_A"), pair.get("lora_B")
        if a is None or b is None:
            raise InvalidRequestError(f"{file}: module {module!r} lacks lora_A or lora_B")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise InvalidRequestError(
                f"{file}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; with r={rank} expected [r, in] and [out, r]"
            )
        modules[module] = (a.float(), b.float())
    if not modules:
        raise InvalidRequestError(f"{file}: no LoRA matrices")
    return modules
