"""The linear layers' kernels: each one against float64, every ISA variant of the
rust kernel forced on this machine, the choice per shape cached on disk, and the
batch-invariant mode's promise through the engine."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from asyncllm import LLM, EngineArgs, SamplingParams, _core
from asyncllm.errors import ConfigError
from asyncllm.models.linear_kernels import BUCKETS, KernelLinear, onednn_available
from asyncllm.worker import linear_select

SHAPES = [(1, 64, 96), (3, 100, 70), (16, 128, 257), (300, 64, 40)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@pytest.mark.parametrize("kernel", ["torch", "onednn", "rust"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_kernel_matches_float64(kernel: str, dtype: torch.dtype) -> None:
    if kernel == "onednn" and not onednn_available(dtype):
        pytest.skip(f"this torch build or CPU has no oneDNN linear in {dtype}")
    torch.manual_seed(0)
    for rows, k, n in SHAPES:
        layer = nn.Linear(k, n, bias=True).to(dtype)
        w, b = layer.weight.detach().clone(), layer.bias.detach().clone()
        fast = KernelLinear(layer.weight, layer.bias, (kernel,) * len(BUCKETS), 2)
        x = torch.randn(rows, k, dtype=dtype)
        with torch.inference_mode():
            got = fast(x).double()
        want = reference(x, w, b)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert got.shape == (rows, n)
        assert (got - want).abs().max().item() <= tol * want.abs().max().item() + tol


def test_three_dimensional_inputs_keep_their_shape() -> None:
    layer = nn.Linear(32, 48, bias=False)
    fast = KernelLinear(layer.weight, None, ("rust",) * len(BUCKETS), 1)
    x = torch.randn(2, 3, 32)
    with torch.inference_mode():
        assert torch.allclose(fast(x), F.linear(x, layer.weight.detach()), atol=1e-5)


def test_a_reordered_weight_serves_every_bucket_alone() -> None:
    layer = nn.Linear(8, 8)
    with pytest.raises(ValueError, match="every bucket"):
        KernelLinear(layer.weight, None, ("onednn",) + ("torch",) * (len(BUCKETS) - 1), 1)


_ISA_CHECK = """
import sys, torch, torch.nn.functional as F
from asyncllm import _core
want = sys.argv[1]
assert _core._linear_isa() == want, (_core._linear_isa(), want)
torch.manual_seed(1)
for dtype in (torch.float32, torch.bfloat16):
    for m, k, n in ((1, 100, 70), (5, 300, 130), (9, 33, 65)):
        x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        def bits(t):
            return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
        _core._linear(bits(out), bits(x), bits(w), None, 2)
        ref = F.linear(x.double(), w.double())
        err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < (1e-6 if dtype == torch.float32 else 1e-2), (want, dtype, m, err)
        # one reduction order for every row count: row 0 alone has the same bits
        alone = torch.empty(1, n, dtype=dtype)
        _core._linear(bits(alone), bits(x[:1].contiguous()), bits(w), None, 1)
        assert torch.equal(alone[0], out[0]), (want, dtype, m)
    # SiLU x up runs on the same variant (its exp vectorised per ISA)
    gate_up = 6 * torch.randn(33, 2 * 72).to(dtype)
    got = torch.empty(33, 72, dtype=dtype)
    _core._silu_mul(bits(got), bits(gate_up), 72, 2)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got, F.silu(gate) * up, rtol=tol, atol=tol)
print("ok", want)
"""


# The CPU flags each variant needs; "avx512bf16" is what "auto" picks where the
# CPU has them (bf16 x bf16 products on vdpbf16ps).
ISA_FLAGS = {
    "portable": [],
    "avx2": ["avx2", "fma"],
    "avx512": ["avx2", "fma", "avx512f"],
    "avx512bf16": ["avx2", "fma", "avx512f", "avx512_bf16"],
}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return ""


@pytest.mark.parametrize("isa", ["portable", "avx2", "avx512", "avx512bf16"])
def test_every_isa_path_forced_matches_the_reference(isa: str) -> None:
    flags = _cpu_flags().split()
    needs = ISA_FLAGS[isa]
    if not flags and isa != "portable":
        pytest.skip("no /proc/cpuinfo: cannot tell which ISA this CPU has")
    missing = [f for f in needs if f not in flags]
    if missing:
        pytest.skip(f"this CPU lacks {missing}")
    env = dict(os.environ, ASYNCLLM_KERNEL_ISA="auto" if isa == "avx512bf16" else isa)
    done = subprocess.run(
        [sys.executable, "-c", _ISA_CHECK, isa],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"ok {isa}" in done.stdout


def test_the_choice_is_measured_once_then_read_from_disk(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    chosen = linear_select.select_linear_kernels(
        model, mode="auto", batch_invariant=False, num_threads=1
    )
    assert len(chosen) == 2 and all(len(v) == len(BUCKETS) for v in chosen.values())
    assert isinstance(model[0], KernelLinear)
    saved = json.loads(linear_select.cache_path().read_text())
    assert list(saved.values())[0].keys() == chosen.keys()

    def no_measuring(*args: object, **kwargs: object) -> tuple[str, ...]:
        raise AssertionError("measured again despite the cache")

    monkeypatch.setattr(linear_select, "_measure", no_measuring)
    again = nn.Sequential(nn.Linear(64, 96), nn.Linear(96, 64, bias=False))
    assert (
        linear_select.select_linear_kernels(
            again, mode="auto", batch_invariant=False, num_threads=1
        )
        == chosen
    )


def test_batch_invariant_mode_runs_rust_everywhere(tmp_path: object) -> None:
    model = nn.Sequential(nn.Linear(16, 16))
    chosen = linear_select.select_linear_kernels(
        model, mode="auto", batch_invariant=True, num_threads=1
    )
    assert set(next(iter(chosen.values()))) == {"rust"}


def test_bad_settings_name_the_field() -> None:
    with pytest.raises(ConfigError, match="linear_kernel"):
        EngineArgs(linear_kernel="blas")
    with pytest.raises(ConfigError, match="batch_invariant"):
        EngineArgs(batch_invariant="yes")  # type: ignore[arg-type]


def test_every_forced_kernel_gives_the_default_models_greedy_text() -> None:
    texts = []
    for kernel in ("torch", "onednn", "rust"):
        llm = LLM(linear_kernel=kernel, multiprocess=False)
        try:
            out = llm.generate(
                ["def add(a, b):"], SamplingParams(temperature=0, max_tokens=16), use_tqdm=False
            )
            texts.append(out[0].outputs[0].text)
        finally:
            llm.shutdown()
    assert texts[0] and texts.count(texts[0]) == 3, texts


def test_the_probes_report_this_machine() -> None:
    flops, isa = _core._fma_peak(1, 200_000)
    assert flops > 1e8 and isa == _core._linear_isa()
    data = torch.ones(1 << 20).numpy()
    assert _core._read_bandwidth(data, 2) > 1e8
