"""Scoring with SmolLM2-135M-Instruct from its GGUF: the log-probability of every
prompt token (the scoring API, `prompt_logprobs`) equals transformers' on the same
file within 1e-3, and the held-out paragraph's perplexity on the engine's default
path (its default dtype and kernels, prefill in chunks of 4 rows that run the small-
row GGUF kernel) stays within 1 % of the reference path's. Faster kernels (integer
GEMMs over the blocks) must keep this test passing. The references are
transformers' float32 log-probabilities, recorded by tools/smollm2_reference.py in
tests/fixtures/smollm2_scores.json."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from asyncllm import LLM, SamplingParams

FIXTURE = Path(__file__).parent / "fixtures" / "smollm2_scores.json"


@pytest.fixture(scope="module")
def texts() -> list[dict[str, Any]]:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))["texts"]  # type: ignore[no-any-return]


def _scores(gguf: Path, texts: list[dict[str, Any]], **engine: Any) -> list[list[float]]:
    """The engine's log-probability of each token after the first, per text."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    prompts = [{"prompt_token_ids": t["token_ids"]} for t in texts]
    with LLM(model=str(gguf), max_model_len=512, **engine) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        [lp[tok].logprob for lp, tok in zip(o.prompt_logprobs[1:], t["token_ids"][1:], strict=True)]
        for o, t in zip(outs, texts, strict=True)
    ]


def _perplexity(logprobs: list[float]) -> float:
    return math.exp(-sum(logprobs) / len(logprobs))


def test_prompt_logprobs_equal_transformers(
    smollm2_gguf: Path, texts: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the reference kernel (float activations); the int8-activation kernels
    are held to the perplexity bound below."""
    monkeypatch.setenv("ASYNCLLM_GGUF_KERNEL", "float")
    got = _scores(smollm2_gguf, texts, dtype="float32")
    for text, scores in zip(texts, got, strict=True):
        worst = max(abs(a - b) for a, b in zip(scores, text["logprobs"], strict=True))
        assert worst <= 1e-3, (text["text"][:40], worst)


def test_heldout_perplexity_of_the_default_path(
    smollm2_gguf: Path, texts: list[dict[str, Any]]
) -> None:
    heldout = texts[-1]
    assert len(heldout["token_ids"]) > 100
    reference = _perplexity(heldout["logprobs"])
    for engine in ({}, {"max_num_batched_tokens": 4, "enable_prefix_caching": False}):
        (scores,) = _scores(smollm2_gguf, [heldout], **engine)
        ppl = _perplexity(scores)
        assert abs(ppl / reference - 1) <= 0.01, (engine, ppl, reference)
