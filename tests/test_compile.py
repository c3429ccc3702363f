"""Fused layers (`EngineArgs.compile`): greedy ids still equal transformers, the
graphs compiled at start-up serve every batch size without a recompile, and the
kernels land in the on-disk cache. One test, on the smallest model: compiling
costs tens of seconds cold."""

from __future__ import annotations

from test_llm_engine import prompts_for, token_ids
from torch._dynamo.utils import counters

from asyncllm import LLM, SamplingParams
from asyncllm.models.hf_config import load_hf_config
from asyncllm.worker import compile as compile_mod
from tiny_models import hf_greedy, make_tiny_model

MAX_TOKENS = 8


def test_compiled_greedy_matches_transformers_without_recompiles(tmp_path, monkeypatch):
    cache = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    # every step through the compiled ops (by default small steps stay eager)
    monkeypatch.setattr(compile_mod, "MIN_TOKENS", 0)
    model_dir = make_tiny_model(tmp_path / "llama", arch="llama", tokenizer="llama-2")
    prompts = prompts_for(load_hf_config(model_dir).vocab_size, lens=(5, 9, 17, 30))
    expected = hf_greedy(model_dir, prompts, MAX_TOKENS)

    llm = LLM(str(model_dir), multiprocess=False, dtype="float32", compile=True)
    model = llm.engine.core.runner.model
    assert all(layer.mlp.ops is compile_mod.size_dispatched_ops() for layer in model.layers)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 4, "start-up compiled no graphs"
    assert any(cache.rglob("*.py")), "no compiled kernel in the on-disk cache"

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # all four at once (a 61-token prefill, then decodes of 4 rows), then one alone
    # (1-token steps) and two together
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert token_ids(outputs) == expected
    assert token_ids(llm.generate(prompts[2:3], params, use_tqdm=False)) == expected[2:3]
    assert token_ids(llm.generate(prompts[:2], params, use_tqdm=False)) == expected[:2]
    assert counters["stats"]["unique_graphs"] == graphs, "a batch size recompiled"
