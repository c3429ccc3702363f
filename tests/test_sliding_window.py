"""Sliding-window models keep a bounded KV cache: once a request is longer than
the window of every layer, the blocks that left it go back to the pool, and the
outputs still equal transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_families import WINDOW, _hf_greedy, make_family_model

from asyncllm import LLM, SamplingParams
from asyncllm.models.hf_config import kv_window, load_hf_config

BLOCK_SIZE = 4
CHUNK = 8  # max_num_batched_tokens: the prompt is prefilled in chunks


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_model(tmp_path_factory.mktemp("mistral"), "mistral-window")


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_long_request_holds_a_bounded_number_of_blocks(mistral_dir: Path, overlap: bool) -> None:
    hf_config = load_hf_config(mistral_dir)
    assert kv_window(hf_config) == WINDOW
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, hf_config.vocab_size, (30,), generator=g).tolist()
    max_tokens = 40
    expected = _hf_greedy(mistral_dir, [prompt], max_tokens)

    llm = LLM(
        str(mistral_dir),
        multiprocess=False,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=CHUNK,
        async_scheduling=overlap,
    )
    core = llm.engine.core
    pool, sched = core.kv_cache.pool, core.scheduler
    held: list[int] = []
    original = sched.schedule

    def schedule():  # after each step's allocation: the blocks in use, from the pool
        out = original()
        held.append(pool.num_blocks - pool.num_free_blocks)
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate([prompt], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected

    # A step's queries span at most CHUNK positions and each reads WINDOW - 1 back,
    # so the blocks it needs cover WINDOW - 1 + CHUNK positions (+1 for alignment).
    bound = -(-(WINDOW - 1 + CHUNK) // BLOCK_SIZE) + 1
    total = -(-(len(prompt) + max_tokens) // BLOCK_SIZE)
    assert max(held) <= bound < total, (held, bound, total)
    assert pool.num_free_blocks == pool.num_blocks  # and everything comes back


def test_any_global_layer_keeps_every_block(tmp_path: Path) -> None:
    """Gemma's global layers and Qwen's first max_window_layers read the whole
    context: nothing can be given back."""
    path = make_family_model(tmp_path / "q", "qwen3-window")
    assert kv_window(load_hf_config(path)) is None


@pytest.mark.parametrize(
    ("arch", "fields", "windows"),
    [
        ("MistralForCausalLM", {"sliding_window": 8}, [8, 8, 8, 8]),
        ("MistralForCausalLM", {"sliding_window": None}, [None] * 4),
        (
            "Qwen2ForCausalLM",
            {"use_sliding_window": True, "max_window_layers": 2},
            [None, None, 4096, 4096],
        ),
        ("Qwen2ForCausalLM", {"sliding_window": 8}, [None] * 4),  # use_sliding_window off
        ("Gemma2ForCausalLM", {"sliding_window": 8}, [8, None, 8, None]),
        ("Gemma3ForCausalLM", {"sliding_window": 8, "sliding_window_pattern": 3}, [8, 8, None, 8]),
        (
            "Gemma3ForCausalLM",
            {"sliding_window": 8, "layer_types": ["full_attention"] + ["sliding_attention"] * 3},
            [None, 8, 8, 8],
        ),
    ],
)
def test_layer_windows_from_config_json(
    tmp_path: Path, arch: str, fields: dict, windows: list
) -> None:
    """Configs written before transformers 5 (no `layer_types`) read as transformers
    reads them."""
    import json

    from asyncllm.models.hf_config import layer_windows

    raw = {"architectures": [arch], "num_hidden_layers": 4, **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert layer_windows(load_hf_config(tmp_path)) == windows
