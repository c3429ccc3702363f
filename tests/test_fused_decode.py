"""The fused decode step (asyncllm.models.fused_decode, rust/kernels/decode_layers.rs):
the same logits as the torch path for Llama and Qwen2 (q/k/v bias) in float32 and
bfloat16, every ISA variant forced on this machine, a row's bits independent of the
rows beside it, clear errors that write nothing, and the torch path wherever the
kernel does not apply."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_linear_kernels import ISA_FLAGS

from asyncllm import EngineArgs, SamplingParams
from asyncllm.core.scheduler_output import NewRequestData, SchedulerOutput
from asyncllm.models.fused_decode import MAX_ROWS, unsupported
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.linear_kernels import as_buffer
from asyncllm.worker.model_runner import ModelRunner
from tiny_models import make_tiny_model

# Prompts that end inside the first block, just past it, and in the second.
PROMPTS = [list(range(5, 10)), list(range(20, 37)), list(range(40, 70))]
DECODES = 20  # crosses block boundaries (block_size 16) for every prompt


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp(request.param), arch=request.param)


def _runner(model_dir: Path, dtype: str, fused: bool) -> ModelRunner:
    hf = load_hf_config(model_dir)
    args = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        num_kv_blocks=64,
        fused_decode=fused,
        linear_kernel="rust",  # the same products on both paths: only fusion differs
    )
    return ModelRunner(args.resolve(hf), hf)


class _Spy:
    """Counts the fused plan's calls and records every step's logits."""

    def __init__(self, runner: ModelRunner) -> None:
        self.logits: list[torch.Tensor] = []
        self.fused_calls = 0
        head = runner.model.compute_logits

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            out = head(hidden)
            self.logits.append(out.clone())
            return out

        runner.model.compute_logits = logits  # type: ignore[method-assign]
        fused = runner.model.fused_decode
        if fused is not None:
            plan = fused.plan
            spy = self

            class Counting:
                def run(self, *args: Any) -> None:
                    spy.fused_calls += 1
                    plan.run(*args)

            fused.plan = Counting()


def _generate(runner: ModelRunner, prompts: list[list[int]], steps: int) -> _Spy:
    """Prefill every prompt in one step, then `steps` decode steps of all of them."""
    spy = _Spy(runner)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    block = 0
    reqs = []
    for i, prompt in enumerate(prompts):
        # four blocks, or as many as the prompt and its decodes fill
        count = max(4, -(-(len(prompt) + steps) // runner.block_size))
        blocks = list(range(block, block + count))
        block += count
        reqs.append(NewRequestData(i, prompt, len(prompt), params, blocks, 0, frozenset()))
    n = {i: len(p) for i, p in enumerate(prompts)}
    runner.execute_model(SchedulerOutput(reqs, {}, n, sum(n.values()))).resolved()
    ones = dict.fromkeys(range(len(prompts)), 1)
    for _ in range(steps):
        runner.execute_model(SchedulerOutput([], {}, ones, len(prompts))).resolved()
    return spy


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_gives_the_torch_paths_logits(model_dir: Path, dtype: str) -> None:
    fused, plain = _runner(model_dir, dtype, True), _runner(model_dir, dtype, False)
    assert fused.model.fused_decode is not None and plain.model.fused_decode is None
    got, want = _generate(fused, PROMPTS, DECODES), _generate(plain, PROMPTS, DECODES)
    assert got.fused_calls == DECODES  # every decode step fused, the prefill not
    assert len(got.logits) == len(want.logits) == DECODES + 1
    assert_same_logits(got, want, 1e-5 if dtype == "float32" else 0.02)


def assert_same_logits(got: _Spy, want: _Spy, tol: float) -> None:
    """The same greedy tokens at every step and logits within `tol`: rounding
    points are the torch path's; exp and the square root may differ from torch's
    vectorised ones in the last bit, which a bf16 value then shows as one unit in
    the last place now and then."""
    for step, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        assert torch.equal(a.argmax(-1), b.argmax(-1)), step
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def assert_row_alone_equals_batch(
    runner: Callable[[], ModelRunner], steps: int, fused: int | None = None
) -> None:
    """The first prompt's logits have the same bits alone and beside the others;
    `fused` steps (default: the decodes) ran the fused call each time."""
    alone = _generate(runner(), PROMPTS[:1], steps)
    batch = _generate(runner(), PROMPTS, steps)
    assert alone.fused_calls == batch.fused_calls == (steps if fused is None else fused)
    for a, b in zip(alone.logits, batch.logits, strict=True):
        assert torch.equal(a[0], b[0])


def test_a_row_gives_the_same_bits_alone_and_in_a_batch(model_dir: Path) -> None:
    assert_row_alone_equals_batch(lambda: _runner(model_dir, "float32", True), 6)


def test_steps_beyond_the_fused_rows_take_the_torch_path(model_dir: Path) -> None:
    prompts = [list(range(3 + i, 9 + i)) for i in range(MAX_ROWS + 1)]
    spy = _generate(_runner(model_dir, "float32", True), prompts, 2)
    assert spy.fused_calls == 0


def test_the_kernel_is_off_where_it_does_not_apply(model_dir: Path) -> None:
    fused = _runner(model_dir, "float32", True)
    assert unsupported(fused.model, fused.kv_caches) is None
    hf = load_hf_config(model_dir)
    for extra in ({"batch_invariant": True}, {"fused_decode": False}):
        args = EngineArgs(model=str(model_dir), device="cpu", num_kv_blocks=64, **extra)
        assert ModelRunner(args.resolve(hf), hf).model.fused_decode is None
    args = EngineArgs(model=str(model_dir), device="cpu", num_kv_blocks=64, linear_kernel="onednn")
    runner = ModelRunner(args.resolve(hf), hf)
    if any("onednn" in k for k in runner.linear_kernels.values()):
        assert runner.model.fused_decode is None
        assert "oneDNN" in str(unsupported(runner.model, runner.kv_caches))


def test_bad_step_inputs_raise_and_write_nothing(model_dir: Path) -> None:
    runner = _runner(model_dir, "float32", True)
    fused = runner.model.fused_decode
    assert fused is not None
    hidden = torch.randn(1, runner.model.hidden_size)
    before, cache = hidden.clone(), runner.kv_caches[0].clone()
    cos_sin = runner.model.rotary_emb.cos_sin_cache[:1].contiguous()
    table = torch.zeros(1, 4, dtype=torch.int64)
    cases = {
        "slot": (torch.tensor([64 * 16]), table, torch.tensor([1])),
        "block id": (torch.tensor([0]), torch.full((1, 4), 64), torch.tensor([1])),
        "seq_len": (torch.tensor([0]), table, torch.tensor([4 * 16 + 1])),
    }
    for name, (slots, tables, lens) in cases.items():
        with pytest.raises(ValueError, match="out of range|not in"):
            fused.plan.run(
                as_buffer(hidden),
                as_buffer(cos_sin),
                slots.numpy(),
                tables.numpy(),
                lens.numpy(),
                1,
            )
        assert torch.equal(hidden, before), name
        assert torch.equal(runner.kv_caches[0], cache), name


_ISA_CHECK = """
import sys, pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", sys.argv[1]]))
"""


def _cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln for ln in f if ln.startswith("flags")), "").split()
    except OSError:
        return []


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512bf16"])
def test_every_isa_path_forced_gives_the_torch_paths_logits(isa: str) -> None:
    needs = ISA_FLAGS[isa]
    flags = _cpu_flags()
    if needs and not flags:
        pytest.skip("no /proc/cpuinfo: cannot tell which ISA this CPU has")
    missing = [f for f in needs if f not in flags]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    test = f"{__file__}::test_fused_decode_gives_the_torch_paths_logits[qwen2-bfloat16]"
    done = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK, test],
        env=dict(os.environ, ASYNCLLM_KERNEL_ISA="auto" if isa == "avx512bf16" else isa),
        cwd=Path(__file__).parents[1],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    if "1 skipped" in done.stdout:  # the inner test's own reason (e.g. no tokenizer assets)
        pytest.skip(done.stdout.strip().splitlines()[-2][-200:])
    assert "1 passed" in done.stdout, done.stdout[-2000:]
