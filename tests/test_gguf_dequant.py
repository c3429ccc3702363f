"""GGUF dequantization (asyncllm.models.gguf.dequant) equals gguf-py's reference bit
for bit, and the layers that compute on blocks equal dequantize + float32 math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from asyncllm.errors import ModelLoadError
from asyncllm.models.gguf import layers
from asyncllm.models.gguf.dequant import (
    BLOCK_SIZES,
    check_type,
    dequantize,
    dequantize_torch,
    row_bytes,
)
from asyncllm.models.gguf.layers import GGUFEmbedding, GGUFLinear

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # gguf-py on NaN scales

TYPES = list(BLOCK_SIZES)
# gguf-py quantizes these itself: blocks as llama.cpp writes them
QUANTIZABLE = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def _random_blocks(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw random bytes, scales included (NaN and infinity among them)."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, size=(rows, row_bytes(qtype, cols)), dtype=np.uint8)


def _quantized(qtype: str, rows: int, cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, cols), dtype=np.float32)
    return quants.quantize(weights, GGMLQuantizationType[qtype])


def _cols(qtype: str) -> int:
    return BLOCK_SIZES[qtype][0] * 3 if BLOCK_SIZES[qtype][0] > 1 else 96


def _same_bits(got: torch.Tensor, want: np.ndarray) -> bool:
    """Equal bits, except that a NaN only has to be a NaN (its payload depends on
    which instruction made it)."""
    values = got.numpy()
    nan = np.isnan(want)
    if not np.array_equal(np.isnan(values), nan):
        return False
    return bool(np.array_equal(values[~nan].view(np.uint32), want[~nan].view(np.uint32)))


# the extension's kernel (the CPU path) and the torch code (other devices)
IMPLEMENTATIONS = {"rust": dequantize, "torch": dequantize_torch}


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("qtype", TYPES)
def test_random_blocks_equal_gguf_py_bit_for_bit(qtype: str, impl: str) -> None:
    raw = _random_blocks(qtype, 37, _cols(qtype), seed=1)
    want = quants.dequantize(raw, GGMLQuantizationType[qtype])
    got = IMPLEMENTATIONS[impl](torch.from_numpy(raw), qtype)
    assert got.shape == want.shape
    assert _same_bits(got, want)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_quantized_blocks_equal_gguf_py_bit_for_bit(qtype: str, impl: str) -> None:
    raw = _quantized(qtype, 19, _cols(qtype), seed=2)
    raw = raw.view(np.uint8).reshape(19, -1)
    want = quants.dequantize(raw, GGMLQuantizationType[qtype])
    assert _same_bits(IMPLEMENTATIONS[impl](torch.from_numpy(raw), qtype), want)


@pytest.mark.parametrize("rows", [1, 3, 9])  # the fused kernel, and tiles + GEMM
@pytest.mark.parametrize("qtype", TYPES)
def test_linear_equals_dequantize_then_float32_matmul(qtype: str, rows: int) -> None:
    cols = max(BLOCK_SIZES[qtype][0] * 2, 64)
    raw = torch.from_numpy(_quantized_or_finite(qtype, 40, cols))
    bias = torch.randn(40)
    layer = GGUFLinear([(qtype, raw)], cols, bias)
    layer.tile_rows = 7  # several tiles, the last one short
    assert (rows <= layers.FUSED_MAX_ROWS) == (rows < 9)  # 1, 3: fused; 9: tiles
    x = torch.randn(rows, cols)
    weight = dequantize(raw, qtype)
    _assert_rounding_close(layer(x), F.linear(x, weight, bias), x, weight)
    assert torch.equal(layer.dequantized(), dequantize(raw, qtype))


def test_linear_of_parts_with_different_types() -> None:
    a = _finite(torch.from_numpy(_random_blocks("Q4_0", 6, 64, seed=4)), "Q4_0", 64)
    b = torch.from_numpy(_quantized("Q8_0", 3, 64, seed=5).view(np.uint8).reshape(3, -1))
    layer = GGUFLinear([("Q4_0", a), ("Q8_0", b)], 64, None)
    x = torch.randn(2, 64)
    weight = torch.cat((dequantize(a, "Q4_0"), dequantize(b, "Q8_0")))
    _assert_rounding_close(layer(x), x @ weight.T, x, weight)
    assert layer.out_features == 9


def test_embedding_dequantizes_the_rows_it_gathers() -> None:
    raw = torch.from_numpy(_quantized("Q8_0", 50, 64, seed=6).view(np.uint8).reshape(50, -1))
    embed = GGUFEmbedding("Q8_0", raw, 64, torch.float32)
    ids = torch.tensor([[3, 49], [0, 3]])
    table = dequantize(raw, "Q8_0")
    assert torch.equal(embed(ids), table[ids])
    head = embed.as_linear()
    assert head.part0.data_ptr() == raw.data_ptr()  # the tied head shares the blocks
    x = torch.randn(2, 64)
    _assert_rounding_close(head(x), x @ table.T, x, table)


def test_unknown_type_is_an_error_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight: type IQ2_XXS"):
        check_type("IQ2_XXS", "blk.0.attn_q.weight")


def _assert_rounding_close(
    got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> None:
    """Equal up to float32 rounding of a sum in another order: the error bound is a
    few ulps of the sum of the terms' magnitudes (|x| · |W|ᵀ), not of the result,
    which may cancel to near zero."""
    bound = 1e-5 * (x.abs() @ weight.abs().T) + 1e-6
    assert bool(((got - want).abs() <= bound).all()), (got - want).abs().max()


def _quantized_or_finite(qtype: str, rows: int, cols: int) -> np.ndarray:
    """Blocks gguf-py quantized, or (the K types, which it cannot quantize) random
    ones with finite scales."""
    if qtype in QUANTIZABLE or qtype == "F32":
        return _quantized(qtype, rows, cols, seed=3).view(np.uint8).reshape(rows, -1)
    raw = torch.from_numpy(_random_blocks(qtype, rows, cols, seed=3))
    return _finite(raw, qtype, cols).numpy()


def _finite(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """Random blocks with their float16 scales replaced by small finite ones (Q6_K's
    int8 sub-scales are finite already)."""
    size = BLOCK_SIZES[qtype][1]
    blocks = raw.reshape(-1, size).clone()
    scales = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2], "Q5_K": [0, 2]}
    offsets = {**scales, "Q6_K": [208]}[qtype]
    scale = torch.rand(blocks.shape[0], 1).to(torch.float16).view(torch.uint8)
    for off in offsets:
        blocks[:, off : off + 2] = scale
    return blocks.reshape(raw.shape[0], -1)


def test_the_portable_linear_path_forced_gives_the_same_results() -> None:
    """`ASYNCLLM_KERNEL_ISA=portable` runs the fused GGUF kernel's plain path (this
    machine's AVX2 path is the one the tests above run): the same checks, every
    type, in a process of its own (the cap is read once)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    test = f"{__file__}::test_linear_equals_dequantize_then_float32_matmul"
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        env=dict(os.environ, ASYNCLLM_KERNEL_ISA="portable"),
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    assert f"{3 * len(TYPES)} passed" in done.stdout, done.stdout[-1000:]
