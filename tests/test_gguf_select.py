"""The GGUF layers' kernel choice at load (asyncllm.worker.gguf_select): measured per
shape and bucket of rows and cached on disk, or forced by ASYNCLLM_GGUF_KERNEL or the
batch-invariant mode."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from torch import nn

from asyncllm.models import kernel_rows
from asyncllm.models.gguf.layers import FUSED_MAX_ROWS, GGUF_KERNELS, GGUFLinear
from asyncllm.models.linear_kernels import BUCKETS
from asyncllm.worker.gguf_select import select_gguf_kernels


def _model() -> nn.Module:
    rng = np.random.default_rng(0)
    raw = quants.quantize(
        rng.standard_normal((48, 64), dtype=np.float32), GGMLQuantizationType.Q4_1
    )
    blocks = torch.from_numpy(raw.view(np.uint8).reshape(48, -1))
    model = nn.Module()
    model.a = GGUFLinear([("Q4_1", blocks)], 64, None)
    model.b = GGUFLinear([("Q4_1", blocks.clone())], 64, None)  # the same shape: one choice
    return model


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("ASYNCLLM_GGUF_KERNEL", raising=False)


def test_measured_choice_is_set_on_every_layer_and_cached(tmp_path: Path) -> None:
    model = _model()
    chosen = select_gguf_kernels(model, batch_invariant=False, num_threads=1, dtype=torch.float32)
    assert list(chosen) == ["gguf:Q4_1:48x64:torch.float32"]
    kernels = chosen["gguf:Q4_1:48x64:torch.float32"]
    assert model.a.kernels == model.b.kernels == kernels
    assert len(kernels) == len(BUCKETS) and set(kernels) <= set(GGUF_KERNELS)
    # one row-invariant kernel for every small bucket (a request's bits do not change
    # as streams come and go), the measured fastest beyond
    for rows, kernel in zip(BUCKETS, kernels, strict=True):
        assert kernel == "int" if rows <= FUSED_MAX_ROWS else kernel != "float"
    assert "gguf:Q4_1:48x64" in (tmp_path / "asyncllm" / "linear-kernels.json").read_text()
    # a second start takes the cached choice
    again = _model()
    select_gguf_kernels(again, batch_invariant=False, num_threads=1, dtype=torch.float32)
    assert again.a.kernels == kernels


def test_forced_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    select_gguf_kernels(model, batch_invariant=True, num_threads=1, dtype=torch.float32)
    assert model.a.kernels == ("int",) * len(BUCKETS)  # a row alone or in a batch: same bits
    monkeypatch.setenv("ASYNCLLM_GGUF_KERNEL", "tiles_bf16")
    select_gguf_kernels(model, batch_invariant=False, num_threads=1, dtype=torch.float32)
    assert model.b.kernels == ("tiles_bf16",) * len(BUCKETS)
    monkeypatch.setenv("ASYNCLLM_GGUF_KERNEL", "fastest")
    with pytest.raises(ValueError, match="ASYNCLLM_GGUF_KERNEL must be"):
        select_gguf_kernels(model, batch_invariant=False, num_threads=1, dtype=torch.float32)


def test_a_verification_step_takes_the_kernels_of_its_decode_step() -> None:
    """Within kernel_rows.choose_by(n) a layer runs bucket n's kernel on however
    many rows it gets (a verification of n requests' drafts): each row gets the
    bits of that kernel, not those of the kernel its row count would pick."""
    layer = _model().a
    layer.set_kernels(tuple("int" if rows <= 4 else "tiles" for rows in BUCKETS))
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        plain = layer(x)
        with kernel_rows.choose_by(4):
            verified = layer(x)
        after = layer(x)
        assert torch.equal(verified, layer.run("int", x))
        assert torch.equal(plain, layer.run("tiles", x)) and torch.equal(after, plain)
        assert not torch.equal(verified, plain)  # the two kernels do round differently
