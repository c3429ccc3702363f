"""The tensors of a prepared GGUF model (see `asyncllm.gguf_files.prepare`): read
by the manifest's byte offsets, and named as the model's checkpoint names them.

llama.cpp names tensors its own way (`blk.3.attn_q.weight`); gguf-py's
`TensorNameMap` maps Hugging Face names to them, which this module uses in reverse
through the model's `weight_sources`. Two conversions llama.cpp applies are undone
here, as transformers' GGUF loader undoes them: the rows of q and k of the llama
architecture are permuted for its rotary layout, and Gemma's norm weights have 1
added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncllm.errors import ModelLoadError
from asyncllm.gguf_files import read_manifest
from asyncllm.models.gguf.dequant import check_type, dequantize


class GGUFTensors:
    """The tensors of one prepared GGUF model, by Hugging Face name."""

    def __init__(self, model_dir: str | Path, hf_config: Any) -> None:
        import gguf

        manifest = read_manifest(model_dir)
        self.files = [Path(f) for f in manifest["files"]]
        self.entries: dict[str, dict[str, Any]] = {t["name"]: t for t in manifest["tensors"]}
        self.arch: str = hf_config.model_type
        arch_ids = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}
        self.names = gguf.get_tensor_name_map(arch_ids[self.arch], hf_config.num_hidden_layers)
        self.num_heads: int = hf_config.num_attention_heads
        self.num_kv_heads: int = hf_config.num_key_value_heads
        self._maps: dict[int, np.ndarray] = {}

    def gguf_name(self, hf_name: str) -> str:
        """The GGUF tensor of a checkpoint tensor name, or ModelLoadError naming it."""
        found = self.names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if found is None or found not in self.entries:
            raise ModelLoadError(
                f"tensor {hf_name!r} ({found or 'no GGUF name'}) is missing from the GGUF model"
            )
        return str(found)

    def qtype(self, hf_name: str) -> str:
        name = self.gguf_name(hf_name)
        qtype = str(self.entries[name]["type"])
        check_type(qtype, name)
        return qtype

    def raw(self, hf_name: str) -> torch.Tensor:
        """The tensor's bytes as uint8 [rows, row_bytes] ([1, bytes] for a vector),
        copied out of the file, q/k rows in Hugging Face order."""
        entry = self.entries[self.gguf_name(hf_name)]
        file = entry["file"]
        if file not in self._maps:
            self._maps[file] = np.memmap(self.files[file], dtype=np.uint8, mode="r")
        start, nbytes = entry["offset"], entry["nbytes"]
        rows = entry["shape"][0] if len(entry["shape"]) > 1 else 1
        data = np.array(self._maps[file][start : start + nbytes]).reshape(rows, -1)
        raw = torch.from_numpy(data)
        if self.arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.num_heads if "q_proj" in hf_name else self.num_kv_heads
            raw = _reverse_permute(raw, heads)
        return raw

    def float(self, hf_name: str) -> torch.Tensor:
        """The tensor dequantized to float32, in its logical shape."""
        entry = self.entries[self.gguf_name(hf_name)]
        out = dequantize(self.raw(hf_name), self.qtype(hf_name)).reshape(entry["shape"])
        if self.arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            out = out - 1
        return out


def _reverse_permute(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of q/k rows (transformers' `_reverse_permute_weights`):
    rows are whole blocks of one output each, so it applies to raw blocks as well."""
    half = rows.shape[0] // heads // 2
    return rows.reshape(heads, half, 2, -1).transpose(1, 2).reshape(rows.shape).contiguous()
