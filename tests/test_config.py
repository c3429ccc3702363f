"""Every argument is checked, and the error names the field, the value and the range."""

from __future__ import annotations

import logging

import pytest

from asyncllm import ConfigError, EngineArgs, SamplingParams
from asyncllm.sampling_params import RequestOutputKind


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("n", 0, ">= 1"),
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, ">= 0"),
        ("temperature", -0.5, "[0, 100]"),
        ("temperature", float("nan"), "[0, 100]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("top_k", -2, "0 / -1 to disable"),
        ("min_p", 1.5, "[0, 1]"),
        ("seed", -1, "2**64"),
        ("stop", [""], "non-empty"),
        ("stop", 5, "non-empty"),
        ("stop_token_ids", [-1], "non-negative"),
        ("logprobs", 21, "[0, 20]"),
        ("prompt_logprobs", -1, "[0, 20]"),
        ("repetition_penalty", 0.0, "(0, 10]"),
        ("frequency_penalty", 2.5, "[-2, 2]"),
        ("presence_penalty", -3, "[-2, 2]"),
        ("ignore_eos", 1, "a bool"),
        ("output_kind", 7, "CUMULATIVE"),
    ],
)
def test_sampling_params_rejects(field, value, allowed):
    with pytest.raises(ConfigError) as err:
        SamplingParams(**{field: value})
    message = str(err.value)
    assert f"SamplingParams.{field}=" in message
    assert repr(value) in message
    assert allowed in message


def test_min_tokens_above_max_tokens_rejected():
    with pytest.raises(ConfigError, match=r"min_tokens=5 .* <= max_tokens \(3\)"):
        SamplingParams(max_tokens=3, min_tokens=5)


def test_sampling_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", output_kind=1)
    assert p.stop_strings == ["###"]
    assert p.output_kind is RequestOutputKind.DELTA
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams().greedy


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("dtype", "float64", "float32"),
        ("kv_cache_dtype", "float16", "auto, bfloat16, float32"),
        ("kv_cache_dtype", "fp8", "auto, bfloat16, float32"),
        ("device", "tpu", "cpu"),
        ("block_size", 0, "[1, 256]"),
        ("block_size", 24, "power of two"),
        ("kv_cache_memory_gib", -1, "(0, 4096]"),
        ("num_kv_blocks", 0, ">= 1"),
        ("max_num_seqs", 0, "[1, 65536]"),
        ("max_num_batched_tokens", 0, "[1, 1048576]"),
        ("max_model_len", 0, ">= 1"),
        ("enable_prefix_caching", "yes", "a bool"),
        ("seed", -5, "[0,"),
        ("num_threads", 0, "[1, 1024]"),
        ("data_parallel_size", 0, "[1, 64]"),
        ("prefix_aware_routing", 1, "a bool"),
        ("model", "", "local Hugging Face model directory"),
    ],
)
def test_engine_args_rejects(field, value, allowed):
    kwargs = {"model": "/some/model", field: value}
    with pytest.raises(ConfigError) as err:
        EngineArgs(**kwargs)
    message = str(err.value)
    assert f"EngineArgs.{field}=" in message
    assert allowed in message


def test_engine_args_size_given_two_ways_rejected():
    with pytest.raises(ConfigError, match="exclusive"):
        EngineArgs(model="/m", num_kv_blocks=10, kv_cache_memory_gib=1)


def test_unknown_engine_argument_named():
    with pytest.raises(ConfigError, match="max_num_seq\\b"):
        EngineArgs.from_kwargs(model="/m", max_num_seq=3)


def test_resolve_caps_context_at_the_model_not_the_sliding_window():
    """Sliding-window attention is real, so Mistral serves its whole position range."""
    from transformers import MistralConfig

    cfg = MistralConfig(max_position_embeddings=32768, sliding_window=4096)
    assert EngineArgs(model="/m", device="cpu").resolve(cfg).max_model_len == 32768
    longer = EngineArgs(model="/m", device="cpu", max_model_len=8192).resolve(cfg)
    assert longer.max_model_len == 8192
    with pytest.raises(ConfigError, match=r"max_model_len=65536 .* <= the model's context 32768"):
        EngineArgs(model="/m", device="cpu", max_model_len=65536).resolve(cfg)


def test_async_scheduling_defaults_to_the_device(monkeypatch):
    """Unset, overlap scheduling is on for CUDA and off on the CPU (and with the
    null executor); the env var and the argument override it either way."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=256)
    monkeypatch.delenv("ASYNCLLM_ASYNC_SCHEDULING", raising=False)
    assert EngineArgs(model="/m", device="cpu").resolve(cfg).async_scheduling is False
    assert EngineArgs(model="/m", executor="null").resolve(cfg).async_scheduling is False
    assert EngineArgs(model="/m", async_scheduling=True).resolve(cfg).async_scheduling is True
    monkeypatch.setenv("ASYNCLLM_ASYNC_SCHEDULING", "1")
    assert EngineArgs(model="/m", device="cpu").resolve(cfg).async_scheduling is True
    with pytest.raises(ConfigError, match="async_scheduling='on' .* None \\(auto\\) or a bool"):
        EngineArgs(model="/m", async_scheduling="on")


@pytest.mark.parametrize(
    ("checkpoint", "requested", "runs"),
    [
        ("float32", "auto", "float32"),
        ("bfloat16", "auto", "bfloat16"),
        ("float16", "auto", "bfloat16"),  # CPU float16 runs as bfloat16
        (None, "auto", "float32"),
        ("float16", "float32", "float32"),
        ("float32", "bfloat16", "bfloat16"),
    ],
)
def test_dtype_auto_follows_the_checkpoint(caplog, checkpoint, requested, runs):
    from transformers import LlamaConfig

    cfg = LlamaConfig(max_position_embeddings=128)
    cfg.torch_dtype = checkpoint
    if checkpoint is None:
        cfg.dtype = None
    with caplog.at_level(logging.INFO, logger="asyncllm.config"):
        config = EngineArgs(model="/m", device="cpu", dtype=requested).resolve(cfg)
    assert config.dtype == runs
    assert config.kv_cache_dtype == runs  # auto: the model's
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("dtype ")]
    assert len(lines) == 1 and lines[0].startswith(f"dtype {runs} (")
    if checkpoint == "float16" and requested == "auto":
        assert "float16" in lines[0] and "CPU" in lines[0]


_GGUF_DTYPE = """
import sys
from pathlib import Path
from asyncllm import EngineArgs, _core
from asyncllm.gguf_files.prepare import prepare_gguf
from asyncllm.models.hf_config import load_hf_config
gguf = sys.argv[1]
hf = load_hf_config(prepare_gguf(Path(gguf)))
auto = EngineArgs(model=gguf, device="cpu", max_model_len=256).resolve(hf).dtype
pinned = EngineArgs(model=gguf, device="cpu", max_model_len=256, dtype="float32").resolve(hf)
print(_core._kernel_isa("bfloat16"), auto, pinned.dtype)
"""


@pytest.mark.parametrize("isa", ["auto", "avx2"])
def test_a_gguf_runs_bf16_where_the_cpu_has_bf16_dots(smollm2_gguf, isa):
    """A GGUF names no activation dtype: auto picks bfloat16 where the kernels run
    bf16 on dot instructions (AVX512-BF16), float32 where they would convert in
    software (the ISA capped to AVX2 checks that side on any machine; the cap is
    read once per process, hence a process each); an explicit dtype wins."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "ASYNCLLM_KERNEL_ISA": isa}
    run = [sys.executable, "-c", _GGUF_DTYPE, str(smollm2_gguf)]
    out = subprocess.run(run, env=env, capture_output=True, text=True, timeout=120, check=True)
    kernel_isa, auto, pinned = out.stdout.split()
    assert auto == ("bfloat16" if kernel_isa == "avx512bf16" else "float32")
    if isa == "avx2":
        assert (kernel_isa, auto) == ("avx2", "float32")
    assert pinned == "float32"


def test_float16_is_refused_on_the_cpu():
    from transformers import LlamaConfig

    with pytest.raises(ConfigError, match=r"EngineArgs.dtype='float16'.*bfloat16"):
        EngineArgs(model="/m", device="cpu", dtype="float16").resolve(LlamaConfig())


@pytest.mark.parametrize(
    ("model", "kv", "want"),
    [
        ("float32", "bfloat16", "bfloat16"),
        ("bfloat16", "float32", "float32"),
        ("bfloat16", "auto", "bfloat16"),
    ],
)
def test_kv_cache_dtype_is_its_own_knob(model, kv, want):
    from transformers import LlamaConfig

    args = EngineArgs(model="/m", device="cpu", dtype=model, kv_cache_dtype=kv)
    config = args.resolve(LlamaConfig(max_position_embeddings=128))
    assert (config.dtype, config.kv_cache_dtype) == (model, want)
    assert EngineArgs.from_json(args.to_json()).kv_cache_dtype == kv


def test_kv_cache_dtype_has_a_cli_flag():
    import argparse

    from asyncllm.cli.args import ENGINE_HELP, add_engine_args, engine_args_from

    assert "model's dtype" in ENGINE_HELP["kv_cache_dtype"]
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["/m", "--kv-cache-dtype", "bfloat16"])
    assert engine_args_from(ns).kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):
        parser.parse_args(["/m", "--kv-cache-dtype", "float16"])


def test_the_grammar_compile_deadline_is_read_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm import envs

    monkeypatch.delenv("ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S", raising=False)
    assert envs.grammar_compile_deadline_s() == 10.0
    monkeypatch.setenv("ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S", "45.5")
    assert envs.grammar_compile_deadline_s() == 45.5
    for bad in ("0", "-3", "soon", "7200"):
        monkeypatch.setenv("ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S", bad)
        with pytest.raises(ConfigError, match=r"GRAMMAR_COMPILE_DEADLINE_S=.*\(0, 3600\]"):
            envs.grammar_compile_deadline_s()
