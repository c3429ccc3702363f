"""The fused decode step over GGUF blocks (asyncllm.models.fused_decode with
models/gguf layers, rust/kernels/decode_proj.rs) on the real SmolLM2 Q4_1: the
torch path's logits in float32 and bfloat16 (prompts included: on the CPU they
attend token-wise, so the call takes them too), a row's bits independent of its
batch, and the torch path wherever the layers chose a kernel the call does not
run or a step brings more than GGUF_MAX_TOKENS tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_fused_decode import (
    PROMPTS,
    _generate,
    assert_row_alone_equals_batch,
    assert_same_logits,
)

from asyncllm import EngineArgs
from asyncllm.gguf_files import prepare_gguf
from asyncllm.models.fused_decode import (
    GGUF_MAX_ROWS,
    GGUF_MAX_TOKENS,
    _gguf_buckets,
    unsupported,
)
from asyncllm.models.gguf.layers import BUCKETS, GGUFLinear
from asyncllm.models.hf_config import load_hf_config
from asyncllm.worker.model_runner import ModelRunner

DECODES = 12


def _runner(gguf: Path, dtype: str, fused: bool, kernel: str = "int") -> ModelRunner:
    folder = prepare_gguf(gguf)
    hf = load_hf_config(folder)
    args = EngineArgs(
        model=str(gguf),
        dtype=dtype,
        device="cpu",
        num_kv_blocks=128,
        max_model_len=512,
        fused_decode=fused,
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCLLM_GGUF_KERNEL", kernel)  # the same kernels on both paths
        return ModelRunner(args.resolve(hf), hf)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_gguf_decode_gives_the_torch_paths_logits(smollm2_gguf: Path, dtype: str) -> None:
    fused, plain = _runner(smollm2_gguf, dtype, True), _runner(smollm2_gguf, dtype, False)
    assert fused.model.fused_decode is not None and plain.model.fused_decode is None
    assert any(isinstance(m, GGUFLinear) for m in fused.model.layers.modules())
    got, want = _generate(fused, PROMPTS, DECODES), _generate(plain, PROMPTS, DECODES)
    assert got.fused_calls == DECODES + 1  # the prompts' step too
    assert_same_logits(got, want, 1e-4 if dtype == "float32" else 0.05)


def test_a_gguf_row_gives_the_same_bits_alone_and_in_a_batch(smollm2_gguf: Path) -> None:
    # the prompts' step runs fused too
    assert_row_alone_equals_batch(lambda: _runner(smollm2_gguf, "float32", True), 4, fused=5)


def test_layers_on_other_kernels_take_the_torch_path(smollm2_gguf: Path) -> None:
    runner = _runner(smollm2_gguf, "float32", True, kernel="tiles")
    assert unsupported(runner.model, runner.kv_caches) is None  # it could run the layers...
    fused = runner.model.fused_decode
    assert fused is not None and fused.buckets == frozenset()  # ...but not their kernels
    assert _generate(runner, PROMPTS[:1], 2).fused_calls == 0


def test_gguf_steps_fuse_up_to_the_integer_kernels_rows(smollm2_gguf: Path) -> None:
    """Where the layers run the integer kernel beyond GGUF_MAX_ROWS rows, the call
    takes those steps; where they chose the tiles there, the torch path runs."""
    prompts = [list(range(3 + i, 9 + i)) for i in range(GGUF_MAX_ROWS + 1)]
    runner = _runner(smollm2_gguf, "float32", True)
    assert _generate(runner, prompts, 2).fused_calls == 3  # prompts and decodes
    runner = _runner(smollm2_gguf, "float32", True)
    for m in runner.model.layers.modules():
        if isinstance(m, GGUFLinear):  # int up to GGUF_MAX_ROWS rows, tiles beyond
            m.set_kernels(tuple("int" if b <= GGUF_MAX_ROWS else "tiles" for b in BUCKETS))
    fused = runner.model.fused_decode
    assert fused is not None
    fused.buckets = _gguf_buckets(runner.model)
    assert _generate(runner, prompts[:2], 2).fused_calls == 3  # 12 prompt tokens
    assert _generate(runner, prompts, 2).fused_calls == 0  # 102 tokens, then 17 rows


def test_gguf_steps_beyond_the_token_cap_take_the_torch_path(smollm2_gguf: Path) -> None:
    runner = _runner(smollm2_gguf, "float32", True)
    fused = runner.model.fused_decode
    assert fused is not None and fused.max_tokens == GGUF_MAX_TOKENS
    fused.max_tokens = 60  # a cap five prompts of four blocks each can pass
    per = fused.max_tokens // 5 + 1
    prompts = [list(range(3 + i, 3 + i + per)) for i in range(5)]
    assert _generate(runner, prompts, 2).fused_calls == 2  # the decodes only


def test_a_gguf_prompt_past_the_layer_buckets_runs_fused(smollm2_gguf: Path) -> None:
    """A prompt longer than the last row bucket (256) runs in the call, on that
    bucket's kernels, with the torch path's logits."""
    fused, plain = _runner(smollm2_gguf, "float32", True), _runner(smollm2_gguf, "float32", False)
    prompts = [list(range(3 + i, 3 + i + 200)) for i in range(2)]  # 400 tokens
    assert BUCKETS[-1] < 400 <= GGUF_MAX_TOKENS
    got, want = _generate(fused, prompts, 2), _generate(plain, prompts, 2)
    assert got.fused_calls == 3
    assert_same_logits(got, want, 1e-4)
