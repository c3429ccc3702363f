"""Speculative decoding with a draft model: a smaller model with the target's
tokenizer proposes, the target verifies. A draft identical to the target has
every greedy draft accepted; a random-weight one almost none; either way the
output is the target's, also across preemption; a draft with another vocabulary
is refused at startup."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncllm import LLM, SamplingParams
from asyncllm.config import EngineArgs
from asyncllm.default_model import DEFAULT_MODEL, resolve_model
from asyncllm.errors import ConfigError, EngineStartupError

TARGET = Path(resolve_model(DEFAULT_MODEL))
PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "Once upon a time there was a little dog.",
    "one two three four five six seven",
    "hello world",
]


def _draft_config(path: Path, k: int = 4) -> dict[str, Any]:
    # every draft verified: the tests count accepted drafts
    return {
        "method": "draft_model",
        "model": str(path),
        "num_speculative_tokens": k,
        "adaptive_drafts": False,
    }


def _random_draft(path: Path, context: int = 512) -> Path:
    """A one-layer random-weight Llama with asyncllm-tiny's tokenizer."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8192,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=context,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    shutil.copy(TARGET / "tokenizer.json", path / "tokenizer.json")
    return path


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_draft(tmp_path_factory.mktemp("draft"))


def _run(spec: dict[str, Any] | None, **kwargs: Any) -> tuple[list[list[int]], Any]:
    params = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.8, seed=7, ignore_eos=True),
    ]
    prompts = [p for p in PROMPTS for _ in params]
    with LLM(num_threads=1, batch_invariant=True, speculative_config=spec, **kwargs) as llm:
        outs = llm.generate(prompts, params * len(PROMPTS), use_tqdm=False)
        stats: Any = llm.engine.call_utility("get_stats")
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.fixture(scope="module")
def baseline() -> list[list[int]]:
    return _run(None)[0]


def test_the_target_as_its_own_draft_has_every_greedy_token_accepted(
    baseline: list[list[int]],
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    with LLM(num_threads=1, batch_invariant=True, speculative_config=_draft_config(TARGET)) as llm:
        out = llm.generate(PROMPTS, params, use_tqdm=False)
        stats: Any = llm.engine.call_utility("get_stats")
    assert [list(o.outputs[0].token_ids) for o in out] == baseline[::2]
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0


def test_a_random_draft_accepts_almost_nothing_and_changes_nothing(
    baseline: list[list[int]], random_draft: Path
) -> None:
    tokens, stats = _run(_draft_config(random_draft))
    assert tokens == baseline
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] <= 0.1 * stats["spec_decode_num_draft_tokens"]


def test_preempted_requests_resume_with_a_fresh_draft(baseline: list[list[int]]) -> None:
    """A KV pool too small for the batch: requests are preempted (their draft
    blocks given back) and resumed; the output is unchanged."""
    tokens, stats = _run(_draft_config(TARGET), num_kv_blocks=10, max_model_len=128)
    assert stats["num_preemptions"] > 0
    assert tokens == baseline


def test_a_draft_with_another_vocabulary_is_refused(tmp_path: Path) -> None:
    shutil.copytree(TARGET, tmp_path / "draft")
    tok = json.loads((TARGET / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    first = next(iter(vocab))
    vocab[first + "_renamed"] = vocab.pop(first)
    (tmp_path / "draft" / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match="share the target's vocabulary"):
        EngineArgs(speculative_config=_draft_config(tmp_path / "draft"))
    with pytest.raises(ConfigError, match="'model'"):
        EngineArgs(speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="config.json"):
        EngineArgs(speculative_config=_draft_config(tmp_path))


def test_a_draft_shorter_than_max_model_len_is_refused(tmp_path: Path) -> None:
    draft = _random_draft(tmp_path, context=128)
    with pytest.raises(EngineStartupError, match="the draft model's context is 128"):
        LLM(num_threads=1, max_model_len=256, speculative_config=_draft_config(draft))


def test_a_gguf_draft(smollm2_gguf: Path) -> None:
    """SmolLM2's GGUF drafting for itself: the same greedy tokens, all accepted."""
    messages = [{"role": "user", "content": "Name three colours."}]
    params = SamplingParams(max_tokens=24, temperature=0)
    outs = []
    for spec in (None, _draft_config(smollm2_gguf, k=3)):
        with LLM(
            model=str(smollm2_gguf),
            dtype="float32",
            max_model_len=256,
            batch_invariant=True,
            speculative_config=spec,
        ) as llm:
            outs.append(list(llm.chat([messages], params, use_tqdm=False)[0].outputs[0].token_ids))
            stats: Any = llm.engine.call_utility("get_stats")
    assert outs[0] == outs[1]
    assert stats["spec_decode_num_accepted_tokens"] == stats["spec_decode_num_draft_tokens"] > 0
