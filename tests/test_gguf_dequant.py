"""GGUF dequantization (asyncllm.models.gguf.dequant) equals gguf-py's reference bit
for bit, and the layers that compute on blocks equal dequantize + float32 math."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

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
from asyncllm.models.gguf.layers import GGUF_KERNELS, INT_TYPES, GGUFEmbedding, GGUFLinear

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


@pytest.mark.parametrize("kernel", GGUF_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 9])
@pytest.mark.parametrize("qtype", TYPES)
def test_linear_equals_dequantize_then_float32_matmul(qtype: str, rows: int, kernel: str) -> None:
    cols = max(BLOCK_SIZES[qtype][0] * 2, 64)
    raw = torch.from_numpy(_quantized_or_finite(qtype, 40, cols))
    bias = torch.randn(40)
    layer = GGUFLinear([(qtype, raw)], cols, bias)
    layer.tile_rows = 7  # several tiles, the last one short
    layer.set_kernels((kernel,) * len(layer.kernels))
    x = torch.randn(rows, cols)
    weight = dequantize(raw, qtype)
    want = F.linear(x, weight, bias)
    if kernel == "int" and qtype in INT_TYPES:
        _assert_int8_close(layer(x), want, x, weight)
    elif kernel == "tiles_bf16":
        _assert_rounding_close(layer(x), want, x, weight, rel=2**-7)
    else:
        _assert_rounding_close(layer(x), want, x, weight)
    assert torch.equal(layer.dequantized(), dequantize(raw, qtype))


def test_default_kernels_by_rows() -> None:
    """Without a measurement: the integer kernel for decode-sized steps, tiles and
    the float GEMM beyond (a step of 9 rows takes the bucket of 16)."""
    kernels = layers.default_kernels()
    assert [kernels[layers.bucket_index(r)] for r in (1, 3, 8, 9, 300)] == [
        "int",
        "int",
        "int",
        "tiles",
        "tiles",
    ]
    with pytest.raises(ValueError, match="kernels must name one of"):
        GGUFLinear([("Q8_0", torch.zeros(2, 34, dtype=torch.uint8))], 32, None).set_kernels(
            ("int",)
        )


def test_linear_of_parts_with_different_types() -> None:
    a = _finite(torch.from_numpy(_random_blocks("Q4_0", 6, 64, seed=4)), "Q4_0", 64)
    b = torch.from_numpy(_quantized("Q8_0", 3, 64, seed=5).view(np.uint8).reshape(3, -1))
    layer = GGUFLinear([("Q4_0", a), ("Q8_0", b)], 64, None)
    x = torch.randn(2, 64)
    weight = torch.cat((dequantize(a, "Q4_0"), dequantize(b, "Q8_0")))
    _assert_int8_close(layer(x), x @ weight.T, x, weight)  # the default at 2 rows
    _assert_rounding_close(layer.run("float", x), x @ weight.T, x, weight)
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
    _assert_rounding_close(head.run("float", x), x @ table.T, x, table)


@pytest.mark.parametrize("kernel", GGUF_KERNELS)
@pytest.mark.parametrize("qtype", TYPES)
def test_panel_layout_changes_no_output(qtype: str, kernel: str) -> None:
    """A layer repacked into the panel layout (as the loader does on the CPU; 40
    rows: two panels and 8 plain rows) gives every kernel's outputs bit for bit,
    and its weight back."""
    cols = max(BLOCK_SIZES[qtype][0] * 2, 64)
    raw = torch.from_numpy(_quantized_or_finite(qtype, 40, cols))
    plain = GGUFLinear([(qtype, raw.clone())], cols, None)
    packed = GGUFLinear([(qtype, raw.clone())], cols, None)
    packed.pack_panels()
    assert packed.panels == ((qtype in INT_TYPES),)
    assert torch.equal(packed.part0, raw) == (qtype not in INT_TYPES)
    plain.tile_rows = packed.tile_rows = 16  # several tiles, the last one short
    for rows in (1, 9, 17):
        x = torch.randn(rows, cols)
        assert torch.equal(packed.run(kernel, x), plain.run(kernel, x)), rows
    assert torch.equal(packed.dequantized(), dequantize(raw, qtype))


def test_a_repacked_embedding_looks_up_and_heads_the_same() -> None:
    raw = torch.from_numpy(_quantized("Q8_0", 50, 64, seed=6).view(np.uint8).reshape(50, -1))
    embed = GGUFEmbedding("Q8_0", raw.clone(), 64, torch.float32)
    embed.pack_panels()
    assert embed.panels and not torch.equal(embed.raw, raw)
    ids = torch.tensor([[3, 49], [0, 17]])
    table = dequantize(raw, "Q8_0")
    assert torch.equal(embed(ids), table[ids])
    head, want = embed.as_linear(), GGUFEmbedding("Q8_0", raw, 64, torch.float32).as_linear()
    assert head.panels == (True,) and head.part0.data_ptr() == embed.raw.data_ptr()
    x = torch.randn(3, 64)
    for kernel in GGUF_KERNELS:
        assert torch.equal(head.run(kernel, x), want.run(kernel, x)), kernel
    with pytest.raises(ValueError, match="past the 50 rows"):
        embed(torch.tensor([50]))


def test_unknown_type_is_an_error_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="blk.0.attn_q.weight: type IQ2_XXS"):
        check_type("IQ2_XXS", "blk.0.attn_q.weight")


def _assert_rounding_close(
    got: torch.Tensor,
    want: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rel: float = 1e-5,
) -> None:
    """Equal up to rounding of a sum in another order (`rel`: float32's few ulps, or
    bfloat16's rounding of x and W): the error bound is relative to the sum of the
    terms' magnitudes (|x| · |W|ᵀ), not to the result, which may cancel to near zero."""
    bound = rel * (x.abs() @ weight.abs().T) + 1e-6
    assert bool(((got - want).abs() <= bound).all()), (got - want).abs().max()


def _assert_int8_close(
    got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> None:
    """Within the integer kernel's rounding of x to int8 per 16 elements: x_i moves
    by at most dx/2 = max|x_group| / 254, so the dot product by at most
    Σ |w_i| · max|x_group(i)| / 254; plus float32 rounding (1e-4 of Σ |x_i w_i|)."""
    amax = x.abs().reshape(x.shape[0], -1, 16).amax(dim=2)
    step = amax.repeat_interleave(16, dim=1) / 254
    bound = step @ weight.abs().T + 1e-4 * (x.abs() @ weight.abs().T) + 1e-6
    assert bool(((got - want).abs() <= bound).all()), (got - want).abs().max()
    assert bool((bound < 0.05 * (x.abs() @ weight.abs().T) + 1e-5).all())  # not vacuous


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
    """`ASYNCLLM_KERNEL_ISA=portable` runs the GGUF kernels' plain paths (this
    machine's vector paths are the ones the tests above run): the same checks,
    every type, in a process of its own (the cap is read once)."""
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
    assert f"{3 * len(TYPES) * len(GGUF_KERNELS)} passed" in done.stdout, done.stdout[-1000:]


# Prints the integer kernel's path and a digest of its outputs on fixed blocks.
_INT_PROBE = """
import hashlib, numpy as np
from asyncllm import _core
rng = np.random.default_rng(0)
digest = hashlib.sha256()
for qtype, size, scales in %r:
    raw = rng.integers(0, 256, size=(21, 2 * size), dtype=np.uint8).reshape(-1, size)
    for at in scales:
        scale = rng.uniform(-0.05, 0.05, (len(raw), 1)).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8)
    raw = raw.reshape(21, -1)
    for m in (1, 5, 11):
        x = rng.standard_normal((m, 512), dtype=np.float32)
        out = np.empty((m, 21), np.float32)
        _core._gguf_linear_int(qtype, out, x, raw, 2)
        digest.update(out.tobytes())
print(_core._gguf_int_isa(), digest.hexdigest())
"""
# (type, bytes per 256 elements, offsets of its f16 scales in those bytes)
_INT_CASES = [
    ("Q8_0", 272, [0, 34, 68, 102, 136, 170, 204, 238]),
    ("Q4_0", 144, [0, 18, 36, 54, 72, 90, 108, 126]),
    ("Q4_1", 160, [0, 2, 20, 22, 40, 42, 60, 62, 80, 82, 100, 102, 120, 122, 140, 142]),
    ("Q5_0", 176, [0, 22, 44, 66, 88, 110, 132, 154]),
    ("Q5_1", 192, [0, 2, 24, 26, 48, 50, 72, 74, 96, 98, 120, 122, 144, 146, 168, 170]),
    ("Q4_K", 144, [0, 2]),
    ("Q5_K", 176, [0, 2]),
    ("Q6_K", 210, [208]),
]


def test_every_integer_path_forced_gives_the_same_bits() -> None:
    """ASYNCLLM_KERNEL_ISA forces each integer path this CPU has (portable, avx2,
    avxvnni, avx512vnni): each runs (it names itself) and gives the portable path's
    outputs bit for bit on every block type (the lanes are exact integers and the
    float steps the same; rust/kernels/gguf_simd.rs)."""
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    wanted = {"portable": True, "avx2": " avx2 " in flags, "avxvnni": " avx_vnni " in flags}
    wanted["avx512vnni"] = " avx512_vnni " in flags and " avx512vl " in flags
    digests = {}
    for isa, present in wanted.items():
        if not present:
            continue
        done = subprocess.run(
            [sys.executable, "-c", _INT_PROBE % (_INT_CASES,)],
            env=dict(os.environ, ASYNCLLM_KERNEL_ISA=isa),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        name, digest = done.stdout.split()
        assert name == isa
        digests[isa] = digest
    assert len(set(digests.values())) == 1, digests


def test_integer_kernel_row_alone_equals_row_in_a_batch() -> None:
    """A row's result from the integer kernel does not depend on the rows beside it
    (rows share each unpacked block in groups of 8, 4, 2, 1; each row's arithmetic
    is the same): what the batch-invariant mode relies on."""
    raw = torch.from_numpy(_quantized_or_finite("Q4_K", 24, 512))
    layer = GGUFLinear([("Q4_K", raw)], 512, None)
    layer.set_kernels(("int",) * len(layer.kernels))
    x = torch.randn(11, 512)
    batch = layer(x)
    for i in (0, 7, 10):
        assert torch.equal(layer(x[i : i + 1]), batch[i : i + 1])
