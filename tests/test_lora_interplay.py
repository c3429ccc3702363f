"""LoRA with the engine's other features: overlap scheduling and n-gram speculative
decoding give peft's greedy tokens; the fused decode step serves adapted rows with
the torch path's numbers; structured output holds under an adapter; quantized base
weights take adapters; prefix-cache keys keep adapters apart; what is not
supported is refused by name at start."""

from __future__ import annotations

from typing import Any

import pytest
from lora_adapters import make_adapter, peft_greedy

from asyncllm import LLM, EngineArgs, LoRARequest, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.structured_output.params import StructuredOutputsParams
from tiny_models import make_tiny_model

PROMPTS = [[1, 306, 4966, 304, 1074, 278], [1, 450, 4996, 17354]]
MAX_TOKENS = 8
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_interplay")
    model = make_tiny_model(tmp / "model", arch="llama")
    paths = [make_adapter(model, tmp / f"a{i}", seed=10 + i, r=8) for i in range(2)]
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(paths)]
    refs = [peft_greedy(model, p, PROMPTS, MAX_TOKENS) for p in paths]
    return {"model": model, "loras": loras, "refs": refs}


def _llm(setup: dict, **kw: object) -> LLM:
    args = dict(enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32") | kw
    return LLM(str(setup["model"]), multiprocess=False, **args)


def _mixed(llm: LLM, setup: dict) -> None:
    """Both prompts under both adapters in one batch equal peft's tokens."""
    loras = setup["loras"]
    prompts = [p for p in PROMPTS for _ in loras]
    per = [lora for _ in PROMPTS for lora in loras]
    outs = llm.generate(prompts, GREEDY, lora_request=per)
    got = [list(o.outputs[0].token_ids) for o in outs]
    expected = [setup["refs"][a][p] for p in range(len(PROMPTS)) for a in range(len(loras))]
    assert got == expected


def test_overlap_scheduling(setup: dict) -> None:
    llm = _llm(setup, async_scheduling=True)
    try:
        _mixed(llm, setup)
    finally:
        llm.shutdown()


def test_ngram_speculative_decoding(setup: dict) -> None:
    """The drafts are verified by the adapted model: the tokens stay peft's."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    spec["adaptive_drafts"] = False  # every draft verified, whatever the timing
    llm = _llm(setup, speculative_config=spec, batch_invariant=True)
    try:
        _mixed(llm, setup)
    finally:
        llm.shutdown()


def _fused_calls(llm: LLM) -> list[int]:
    """A counter of the fused decode step's calls (stays [0] without one)."""
    calls = [0]
    fused = llm.engine.core.runner.model.fused_decode
    if fused is not None:
        plan = fused.plan

        class Counting:
            def run(self, *args: Any) -> None:
                calls[0] += 1
                plan.run(*args)

        fused.plan = Counting()
    return calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_serves_adapted_rows_as_the_torch_path(setup: dict, dtype: str) -> None:
    """Decode steps with adapted (and base) rows stay on the fused decode step, which
    adds the adapters by the torch path's kernel: the same tokens and logprobs as
    with fused decode off (float32: peft's tokens; bfloat16: within its rounding)."""
    loras = setup["loras"]
    prompts = [p for p in PROMPTS for _ in range(3)]
    per = [lora for _ in PROMPTS for lora in (*loras, None)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = []
    for fused in (True, False):
        # the same products on both paths (linear_kernel): only fusion differs
        llm = _llm(setup, dtype=dtype, fused_decode=fused, linear_kernel="rust")
        try:
            calls = _fused_calls(llm)
            outs = [o.outputs[0] for o in llm.generate(prompts, params, lora_request=per)]
        finally:
            llm.shutdown()
        runs.append((calls[0], outs))
    (calls, got), (_, want) = runs
    assert calls >= MAX_TOKENS - 1  # every decode step fused
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if dtype == "float32":
        refs = setup["refs"]
        base = [list(o.token_ids) for o in want[2::3]]
        assert [list(o.token_ids) for o in got] == [
            ids for p in range(len(PROMPTS)) for ids in (refs[0][p], refs[1][p], base[p])
        ]
    tol = 1e-5 if dtype == "float32" else 0.02
    for a, b in zip(got, want, strict=True):
        for pa, pb in zip(a.logprobs, b.logprobs, strict=True):
            assert pa.keys() == pb.keys()
            for t in pa:
                assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=tol)


def test_structured_output_under_an_adapter(setup: dict) -> None:
    llm = _llm(setup)
    try:
        choice = StructuredOutputsParams(choice=["yes", "no", "maybe"])
        p = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs=choice)
        out = llm.generate(["Is it?"], p, lora_request=setup["loras"][0])[0]
        # the grammar's text, then the EOS it allows only at the end (this tiny
        # model's llama-2 tokenizer spells EOS out as "</s>")
        c = out.outputs[0]
        assert c.finish_reason == "stop" and c.token_ids[-1] == 2
        assert c.text.removesuffix("</s>").strip() in ("yes", "no", "maybe")
    finally:
        llm.shutdown()


def test_quantized_base_takes_adapters(setup: dict) -> None:
    """int8 base weights: an adapter still changes the output, and the same adapter
    alone and in a mixed batch gives the same tokens."""
    llm = _llm(setup, quantization="int8")
    try:
        base = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]
        alone = llm.generate(PROMPTS, GREEDY, lora_request=setup["loras"][0])
        alone_ids = [list(o.outputs[0].token_ids) for o in alone]
        assert alone_ids != base
        mixed = llm.generate(PROMPTS * 2, GREEDY, lora_request=[setup["loras"][0]] * 2 + [None] * 2)
        assert [list(o.outputs[0].token_ids) for o in mixed] == alone_ids + base
    finally:
        llm.shutdown()


def test_prefix_cache_keeps_adapters_apart(setup: dict) -> None:
    """A long shared prompt cached under one adapter is not reused by the other or
    by the base model, and is reused by the same adapter."""
    llm = _llm(setup, block_size=4)
    prompt = list(range(100, 140))
    p = SamplingParams(max_tokens=2, temperature=0.0)
    try:
        first = llm.generate([prompt], p, lora_request=setup["loras"][0])[0]
        other = llm.generate([prompt], p, lora_request=setup["loras"][1])[0]
        base = llm.generate([prompt], p)[0]
        again = llm.generate([prompt], p, lora_request=setup["loras"][0])[0]
        assert (first.num_cached_tokens, other.num_cached_tokens, base.num_cached_tokens) == (
            0,
            0,
            0,
        )
        assert again.num_cached_tokens and again.num_cached_tokens >= 36
    finally:
        llm.shutdown()


def test_a_request_naming_an_adapter_needs_enable_lora(setup: dict) -> None:
    from asyncllm.errors import InvalidRequestError

    llm = LLM(str(setup["model"]), multiprocess=False, dtype="float32")
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora is False"):
            llm.generate(PROMPTS[:1], GREEDY, lora_request=setup["loras"][0])
    finally:
        llm.shutdown()


def test_unsupported_combinations_are_refused_at_start() -> None:
    message = "executor='null' is invalid: must be 'torch' with enable_lora"
    with pytest.raises(ConfigError, match=message):
        EngineArgs(enable_lora=True, executor="null")
