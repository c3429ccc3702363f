"""The Rust paged decode-attention kernel through its binding: agreement with the
torch path (gather, then SDPA) and the argument checks. The kernel's own tests
against an f64 reference are in rust/kernels/tests.rs."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from asyncllm import _core


def _case(heads: int, kv_heads: int, head_dim: int, lens: list[int], seed: int = 0):
    rng = np.random.default_rng(seed)
    block_size = 16
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    perm = rng.permutation(num_blocks)
    tables = np.zeros((len(lens), max(blocks) + 1), np.int64)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    q = torch.randn(len(lens), heads, head_dim)
    return q, cache, tables, np.array(lens, np.int64)


def _reference(q, cache, tables, lens, scale):
    group = q.shape[1] // cache.shape[3]
    outs = []
    for b, n in enumerate(lens):
        kv = cache[:, torch.from_numpy(tables[b])].flatten(1, 2)[:, :n]  # [2, n, Hkv, D]
        k, v = (x.transpose(0, 1).repeat_interleave(group, 0) for x in kv)
        outs.append(F.scaled_dot_product_attention(q[b, :, None], k, v, scale=scale).flatten())
    return torch.stack(outs)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (8, 2, 64), (8, 4, 128)])
@pytest.mark.parametrize("threads", [1, 2])
def test_matches_sdpa(heads: int, kv_heads: int, head_dim: int, threads: int) -> None:
    lens = [1, 16, 17, 90, 300, 5]
    q, cache, tables, seq_lens = _case(heads, kv_heads, head_dim, lens)
    scale = head_dim**-0.5
    out = torch.empty(len(lens), heads * head_dim)
    _core._paged_decode_attention(
        out.numpy(), q.numpy(), cache.numpy(), tables, seq_lens, scale, threads
    )
    torch.testing.assert_close(out, _reference(q, cache, tables, seq_lens, scale))


def test_int32_tables_give_the_same_result() -> None:
    q, cache, tables, lens = _case(4, 2, 32, [20, 40])
    a, b = torch.empty(2, 128), torch.empty(2, 128)
    _core._paged_decode_attention(a.numpy(), q.numpy(), cache.numpy(), tables, lens, 0.2, 2)
    _core._paged_decode_attention(
        b.numpy(), q.numpy(), cache.numpy(), tables.astype(np.int32), lens.astype(np.int32), 0.2, 2
    )
    assert torch.equal(a, b)


def test_bad_arguments_raise_value_error_and_write_nothing() -> None:
    q, cache, tables, lens = _case(4, 2, 32, [20, 40])
    out = torch.full((2, 128), 7.0)

    def call(**kw):
        args = dict(
            out=out.numpy(),
            q=q.numpy(),
            kv_cache=cache.numpy(),
            block_tables=tables,
            seq_lens=lens,
            scale=0.2,
            num_threads=1,
        )
        args.update(kw)
        with pytest.raises(ValueError) as info:
            _core._paged_decode_attention(**args)
        assert bool((out == 7.0).all())
        return str(info.value)

    assert "float32" in call(q=q.double().numpy())
    assert "C-contiguous" in call(q=q.transpose(0, 1).numpy())
    assert "3 dimensions" in call(q=q.flatten(1).numpy())
    assert "kv_cache" in call(kv_cache=cache[:, :, :, :, :16].contiguous().numpy())
    assert "seq_len" in call(seq_lens=np.array([20, 0]))
    bad = tables.copy()
    bad[1, 0] = cache.shape[1]
    assert "block id" in call(block_tables=bad)
    assert "overlap" in call(out=cache.view(-1)[: 2 * 128].view(2, 128).numpy())
    assert "num_threads" in call(num_threads=0)
    assert "writable" in call(out=np.frombuffer(bytes(2 * 128 * 4), np.float32).reshape(2, 128))


def test_the_kernel_binding_is_private() -> None:
    """Only asyncllm.models.attention may call it: it releases the GIL and reads
    the KV cache in place, which is sound only while no other thread writes it."""
    assert not hasattr(_core, "paged_decode_attention")
    assert "paged_decode_attention" not in getattr(_core, "__all__", [])


def test_inputs_aliasing_out_are_read_before_it_is_written() -> None:
    # q, block tables and lengths are copied before the kernel runs, so a q that
    # shares memory with out still gives the result of a separate q.
    q, cache, tables, lens = _case(4, 4, 32, [20, 40])
    want = torch.empty(2, 128)
    _core._paged_decode_attention(want.numpy(), q.numpy(), cache.numpy(), tables, lens, 0.2, 1)
    shared = q.clone()
    _core._paged_decode_attention(
        shared.view(2, 128).numpy(), shared.numpy(), cache.numpy(), tables, lens, 0.2, 1
    )
    assert torch.equal(shared.view(2, 128), want)


# --- bfloat16 caches -------------------------------------------------------------


def _bf16_against_f32(threads: int) -> None:
    """The kernel on a bfloat16 cache and q equals it on the same values in float32."""
    q, cache, tables, lens = _case(8, 2, 64, [1, 16, 17, 90, 300, 5], seed=3)
    q16, cache16 = q.to(torch.bfloat16), cache.to(torch.bfloat16)
    scale = 64**-0.5
    want, got = torch.empty(6, 512), torch.empty(6, 512)
    _core._paged_decode_attention(
        want.numpy(), q16.float().numpy(), cache16.float().numpy(), tables, lens, scale, threads
    )
    _core._paged_decode_attention(
        got.numpy(),
        q16.float().numpy(),
        cache16.view(torch.int16).numpy(),
        tables,
        lens,
        scale,
        threads,
    )
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    # and both near the float32 SDPA of the unrounded inputs, as bf16 allows
    ref = _reference(q, cache, tables, lens, scale)
    torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("threads", [1, 2])
def test_bf16_cache_equals_f32_cache_on_rounded_inputs(threads: int) -> None:
    forced = os.environ.get("ASYNCLLM_KERNEL_ISA")
    if forced == "portable":
        assert _core._kernel_isa("bfloat16") == "portable"
    _bf16_against_f32(threads)


def test_portable_path_is_forced_by_the_environment() -> None:
    """ASYNCLLM_KERNEL_ISA=portable runs the kernel without SIMD intrinsics (what a
    CPU without AVX2 or AVX512-BF16 runs): the bf16 test passes on that path too.
    The variable is read once per process, hence the child process."""
    env = dict(os.environ, ASYNCLLM_KERNEL_ISA="portable")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            __file__,
            "-k",
            "bf16_cache_equals_f32",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "2 passed" in result.stdout


def test_kernel_isa_names_the_variant_and_rejects_other_dtypes() -> None:
    assert _core._kernel_isa("float32") in {"portable", "avx2", "avx512"}
    assert _core._kernel_isa("bfloat16") in {"portable", "avx2", "avx512", "avx512bf16"}
    with pytest.raises(ValueError, match="dtype"):
        _core._kernel_isa("float16")


def test_bad_isa_variable_raises_value_error() -> None:
    env = dict(os.environ, ASYNCLLM_KERNEL_ISA="sse9")
    code = (
        "from asyncllm import _core\n"
        "try:\n _core._kernel_isa('float32')\n"
        "except ValueError as e:\n print(e)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert "ASYNCLLM_KERNEL_ISA must be" in out.stdout, out.stderr
