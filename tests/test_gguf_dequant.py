"""GGUF dequantization (asyncllm.models.gguf.dequant) equals gguf-py's reference bit
for bit, and the layers that compute on blocks equal dequantize + float32 math."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType, quants

from asyncllm.errors import ModelLoadError
from asyncllm.models.gguf.dequant import BLOCK_SIZES, check_type, dequantize, row_bytes
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


@pytest.mark.parametrize("qtype", TYPES)
def test_random_blocks_equal_gguf_py_bit_for_bit(qtype: str) -> None:
    raw = _random_blocks(qtype, 37, _cols(qtype), seed=1)
    want = quants.dequantize(raw, GGMLQuantizationType[qtype])
    got = dequantize(torch.from_numpy(raw), qtype)
    assert got.shape == want.shape
    assert _same_bits(got, want)


@pytest.mark.parametrize("qtype", QUANTIZABLE)
def test_quantized_blocks_equal_gguf_py_bit_for_bit(qtype: str) -> None:
    raw = _quantized(qtype, 19, _cols(qtype), seed=2)
    raw = raw.view(np.uint8).reshape(19, -1)
    want = quants.dequantize(raw, GGMLQuantizationType[qtype])
    assert _same_bits(dequantize(torch.from_numpy(raw), qtype), want)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q6_K"])
def test_linear_equals_dequantize_then_float32_matmul(qtype: str) -> None:
    cols = BLOCK_SIZES[qtype][0] * 4
    raw = torch.from_numpy(_random_blocks(qtype, 40, cols, seed=3))
    # scales from random bytes may be NaN or huge: keep finite, small ones
    raw = _finite(raw, qtype, cols)
    bias = torch.randn(40)
    layer = GGUFLinear([(qtype, raw)], cols, bias)
    layer.tile_rows = 7  # several tiles, the last one short
    x = torch.randn(5, cols)
    want = F.linear(x, dequantize(raw, qtype), bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(layer.dequantized(), dequantize(raw, qtype))


def test_linear_of_parts_with_different_types() -> None:
    a = _finite(torch.from_numpy(_random_blocks("Q4_0", 6, 64, seed=4)), "Q4_0", 64)
    b = torch.from_numpy(_quantized("Q8_0", 3, 64, seed=5).view(np.uint8).reshape(3, -1))
    layer = GGUFLinear([("Q4_0", a), ("Q8_0", b)], 64, None)
    x = torch.randn(2, 64)
    weight = torch.cat((dequantize(a, "Q4_0"), dequantize(b, "Q8_0")))
    torch.testing.assert_close(layer(x), x @ weight.T, rtol=1e-5, atol=1e-4)
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
    torch.testing.assert_close(head(x), x @ table.T, rtol=1e-5, atol=1e-4)


def test_unknown_type_is_an_error_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight: type IQ2_XXS"):
        check_type("IQ2_XXS", "blk.0.attn_q.weight")


def _finite(raw: torch.Tensor, qtype: str, cols: int) -> torch.Tensor:
    """Random blocks with their float16 scales replaced by small finite ones (Q6_K's
    int8 sub-scales are finite already)."""
    size = BLOCK_SIZES[qtype][1]
    blocks = raw.reshape(-1, size).clone()
    offsets = {"Q4_0": [0], "Q4_1": [0, 2], "Q8_0": [0], "Q6_K": [208]}[qtype]
    scale = torch.rand(blocks.shape[0], 1).to(torch.float16).view(torch.uint8)
    for off in offsets:
        blocks[:, off : off + 2] = scale
    return blocks.reshape(raw.shape[0], -1)
