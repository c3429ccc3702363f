"""Sliding-window models keep a bounded KV cache: once a request is longer than
the window of every layer, the blocks that left it go back to the pool, and the
outputs still equal transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_model_families import WINDOW, make_family_model

from asyncllm import LLM, SamplingParams
from asyncllm.models.hf_config import kv_window, load_hf_config
from tiny_models import hf_greedy

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
    expected = hf_greedy(mistral_dir, [prompt], max_tokens)

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


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_more_long_requests_than_the_pool_holds_at_full_length(
    mistral_dir: Path, overlap: bool
) -> None:
    """A pool of 12 blocks (48 tokens) serves 4 requests of 50 tokens each (52
    blocks at full length), all at once: each counts only what its window holds,
    its prompt (5 windows long) runs in the chunks that fit, and the outputs still
    equal transformers."""
    hf_config = load_hf_config(mistral_dir)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, hf_config.vocab_size, (30,), generator=g).tolist() for _ in "abcd"]
    max_tokens = 20
    expected = hf_greedy(mistral_dir, prompts, max_tokens)
    num_blocks = 12
    full_length = -(-(30 + max_tokens) // BLOCK_SIZE)
    assert len(prompts) * full_length > 4 * num_blocks  # could not even hold 4 requests' worth

    llm = LLM(
        str(mistral_dir),
        multiprocess=False,
        dtype="float32",
        block_size=BLOCK_SIZE,
        num_kv_blocks=num_blocks,
        max_num_batched_tokens=64,  # a whole prompt per step if the pool had room
        async_scheduling=overlap,
    )
    core = llm.engine.core
    pool, sched = core.kv_cache.pool, core.scheduler
    running: list[int] = []
    original = sched.schedule

    def schedule():  # after each step's allocation: how many requests hold blocks
        out = original()
        running.append(len(sched.running))
        return out

    sched.schedule = schedule  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == expected
    assert max(running) == len(prompts), running  # all four at once, in 12 blocks
    assert pool.num_free_blocks == pool.num_blocks


def test_prefix_hit_takes_only_the_blocks_in_its_window() -> None:
    """A windowed request whose first 40 tokens are cached (10 blocks, all on the
    free list) shares only the 2 its first query can read, so it is admitted where
    taking all 10 would leave 1 free block for the 2 new ones its chunk needs."""
    from asyncllm.core.kv_cache_manager import KVCacheManager
    from asyncllm.core.request import Request
    from asyncllm.core.scheduler import Scheduler

    def request(rid: int, num_tokens: int) -> Request:
        return Request(
            rid,
            list(range(1, num_tokens + 1)),
            SamplingParams(max_tokens=1),
            eos_token_ids=[0],
            max_model_len=256,
            block_size=BLOCK_SIZE,
            hash_blocks=True,
        )

    kv = KVCacheManager(16, BLOCK_SIZE, True, sliding_window=WINDOW)
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    sched.add_request(request(1, 41))
    so = sched.schedule()  # the whole prompt in one step: 11 blocks, 10 of them full
    sched.update_from_output(so, {1: 7})
    assert not sched.has_unfinished_requests()
    kv.pool.get_new_blocks(5)  # the never-used blocks: the 11 cached ones are left
    assert kv.num_free_blocks == 11
    sched.add_request(request(2, 48))
    so = sched.schedule()
    assert so.num_scheduled_tokens == {2: 8}  # 40 tokens hit, 8 to compute
    assert kv.prefix_cache_hits == 40
    # the 2 hit blocks in the window (positions 32..39) and 2 new ones; 8 stay cached
    assert kv.num_held_blocks(2) == 4
    assert kv.num_free_blocks == 11 - 4


@pytest.mark.parametrize("softcap", [None, 5.0], ids=["plain", "softcap"])
def test_torch_window_decode_gathers_only_the_window(softcap: float | None) -> None:
    """The torch decode path (CUDA, half precision, soft-capping) of a sliding-window
    layer gathers each decode's window, not its context: the same number of
    blocks at every context length, and the output of the Rust kernel's path (or,
    soft-capped, of attending over the whole context with the window masked)."""
    import numpy as np

    from asyncllm.models import attention

    window, bs, heads, kv_heads, dim = 20, 4, 4, 2, 16
    num_blocks = 300
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim, generator=g)
    widths = []
    for scale in (1, 2, 4, 8):  # decodes of context up to `scale` windows
        lens = np.array([3, window - 1, window, window + 1, scale * window, scale * window + 3])
        perm = torch.randperm(num_blocks, generator=g).numpy()
        max_blocks = int(-(-lens.max() // bs))
        tables = perm[: len(lens) * max_blocks].reshape(len(lens), max_blocks)
        slots = tables[np.arange(len(lens)), (lens - 1) // bs] * bs + (lens - 1) % bs
        meta = attention.build_attention_metadata(
            np.ones(len(lens), np.int64), lens - 1, tables, slots, bs, torch.device("cpu")
        )
        q = torch.randn(len(lens), heads, dim, generator=g)
        k = v = torch.randn(len(lens), kv_heads, dim, generator=g)
        # the kernel's path, which writes this step's k/v into the cache first
        kernel = attention.paged_attention(q, k, v, cache, meta, 0.25, window=window)
        group = meta.window_decodes(window)
        widths.append(group.block_tables.shape[1])
        got = attention._torch_decode_group(q, cache, group, 0.25, softcap)
        if softcap is None:
            want = kernel
        else:  # the whole context, the window masked
            cols = np.arange(lens.max())[None, :]
            keep = (cols < lens[:, None]) & (cols >= lens[:, None] - window)
            full = attention.DecodeGroup(
                None,
                meta.decode_block_tables,
                int(lens.max()),
                torch.from_numpy(keep)[:, None, None],
            )
            want = attention._torch_decode_group(q, cache, full, 0.25, softcap)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert widths == [-(-window // bs) + 1] * 4, widths  # flat in the context length


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


@pytest.mark.parametrize(
    ("arch", "config_name", "fields"),
    [
        ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {"use_sliding_window": True}),
        (
            "Qwen2MoeForCausalLM",
            "Qwen2MoeConfig",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3},
        ),
        ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", {"sliding_window": 8}),
        (
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        ),
        (
            "Qwen3ForCausalLM",
            "Qwen3Config",
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        ),
        ("MixtralForCausalLM", "MixtralConfig", {"sliding_window": 8}),
    ],
)
def test_layer_windows_as_transformers_reads_them(
    tmp_path: Path, arch: str, config_name: str, fields: dict
) -> None:
    """A config.json without `layer_types` means the windows transformers' config
    class derives from it (Qwen2-MoE: every other layer below max_window_layers;
    Qwen3-MoE and Mixtral: every layer, max_window_layers aside)."""
    import json

    import transformers

    from asyncllm.models.hf_config import layer_windows

    raw = {"architectures": [arch], "num_hidden_layers": 6, **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = getattr(transformers, config_name)(
        **{k: v for k, v in raw.items() if k != "architectures"}
    )
    types = getattr(theirs, "layer_types", None)
    if types is None:  # the model applies `sliding_window` to every layer
        want = [theirs.sliding_window or None] * 6
    else:
        want = [theirs.sliding_window if t == "sliding_attention" else None for t in types]
    assert layer_windows(load_hf_config(tmp_path)) == want
    assert any(w is not None for w in want) == bool(
        fields.get("use_sliding_window", arch.startswith("Mixtral"))
    )
