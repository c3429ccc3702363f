"""The adapter weight reader (`lora.safetensors_file`) against the safetensors
package: the same tensors, bit for bit, in every dtype it takes; a damaged file is
refused with its name and what is wrong, never read past its end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from asyncllm.errors import InvalidRequestError
from asyncllm.lora.safetensors_file import read_tensors


def _write(path: Path) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.lora_A.weight": torch.randn(4, 7, generator=g),
        "a.lora_B.weight": torch.randn(5, 4, generator=g).to(torch.bfloat16),
        "b.lora_A.weight": torch.randn(3, 3, generator=g).to(torch.float16),
        "empty": torch.zeros(0, 4),
    }
    save_file(tensors, path, metadata={"format": "pt"})
    return path


def test_reads_what_safetensors_reads(tmp_path: Path) -> None:
    file = _write(tmp_path / "w.safetensors")
    want, got = load_file(file), read_tensors(file)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    data = _write(tmp_path / "w.safetensors").read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    with pytest.raises(InvalidRequestError, match="cut.safetensors: tensor .* do not hold"):
        read_tensors(cut)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(InvalidRequestError, match="junk.safetensors: not a safetensors file"):
        read_tensors(junk)
    size = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + size].replace(b'"F32"', b'"I64"')
    other = tmp_path / "other.safetensors"
    other.write_bytes(data[:8] + header + data[8 + size :])
    with pytest.raises(InvalidRequestError, match="dtype 'I64'.* expected F32, F16 or BF16"):
        read_tensors(other)
