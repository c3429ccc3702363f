"""A slot rewritten with another adapter computes exactly that adapter: the host's
lay-out (`lay_out_slot`, scale folded in, smaller ranks and left-alone projections
zero) and the write over a slot that held a different adapter, for float32 and
bfloat16 and both kernels, against the products written out per projection."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from asyncllm.lora.layers import LoRALinear, LoRAStep, lay_out_slot

SLICES = (24, 8, 8)  # a fused q/k/v-like layer
IN, MAX_RANK, SCALE = 32, 8, 0.75


def _pairs(seed: int, ranks: tuple[int | None, ...]) -> list:
    """Per projection (A [r, in], B [out_k, r]) in float32, or None (left alone)."""
    g = torch.Generator().manual_seed(seed)
    return [
        None if r is None else (torch.randn(r, IN, generator=g), torch.randn(size, r, generator=g))
        for r, size in zip(ranks, SLICES, strict=True)
    ]


def _expected(base: nn.Linear, x: torch.Tensor, pairs: list) -> torch.Tensor:
    parts = [
        torch.zeros(x.shape[0], size, dtype=torch.float64)
        if pair is None
        else SCALE * (x.double() @ pair[0].double().T) @ pair[1].double().T
        for pair, size in zip(pairs, SLICES, strict=True)
    ]
    return base(x).double() + torch.cat(parts, dim=1)


@pytest.mark.parametrize("kernel", ["rust", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()  # as the engine runs the model
def test_a_rewritten_slot_computes_the_new_adapter(kernel: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    base = nn.Linear(IN, sum(SLICES), bias=False).to(dtype)
    step = LoRAStep(kernel, 2)
    layer = LoRALinear(base, SLICES, 3, MAX_RANK, dtype, torch.device("cpu"), step)
    x = torch.randn(5, IN).to(dtype)
    step.active, step.token_slot = True, np.full(5, 1, dtype=np.int64)
    step.single = 1
    full = _pairs(1, (8, 8, 8))
    # each adapter written over the one before it in slot 1
    for seed, ranks in ((2, (4, None, 8)), (3, (None, 2, None)), (4, (8, 8, 8))):
        layer.set_slot(1, lay_out_slot(full, IN, SLICES, MAX_RANK, SCALE, dtype))
        pairs = _pairs(seed, ranks)
        layer.set_slot(1, lay_out_slot(pairs, IN, SLICES, MAX_RANK, SCALE, dtype))
        tol = 1e-4 if dtype == torch.float32 else 0.1
        torch.testing.assert_close(layer(x).double(), _expected(base, x, pairs), rtol=tol, atol=tol)
    assert lay_out_slot([None, None, None], IN, SLICES, MAX_RANK, SCALE, dtype) is None
    layer.set_slot(1, None)  # an adapter that leaves this layer alone: the base output
    assert torch.equal(layer(x), base(x))
