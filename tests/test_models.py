"""Our models over the paged KV cache against transformers, and loading errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from asyncllm.errors import ModelLoadError
from asyncllm.models import attention
from asyncllm.models.attention import build_attention_metadata
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from tiny_models import make_tiny_model

CPU = torch.device("cpu")
BLOCK_SIZE = 4


class PagedDriver:
    """Runs hand-scheduled steps through the model with a tiny block allocator that
    hands out blocks in a shuffled order, so block ids are never contiguous."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64, seed: int = 0) -> None:
        self.model = model
        gen = torch.Generator().manual_seed(seed)
        shape = (2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
        # Finite garbage, so a slot read without being written spoils the result.
        self.kv_caches = [torch.randn(shape, generator=gen) * 50 for _ in range(model.num_layers)]
        self.free = list(np.random.default_rng(seed).permutation(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}
        self.num_decode_groups: list[int] = []  # per step: the torch path's decode groups

    def step(self, tokens: list[list[int]], work: list[tuple[int, int]]) -> list[torch.Tensor]:
        """Run one step: `work` is (sequence, number of new tokens), decodes first.
        Returns each sequence's logits [n, vocab] for its new tokens."""
        ids, positions, slots, query_lens, context_lens = [], [], [], [], []
        for seq, n in work:
            ctx = self.num_cached.get(seq, 0)
            table = self.tables.setdefault(seq, [])
            while len(table) * BLOCK_SIZE < ctx + n:
                table.append(int(self.free.pop()))
            for pos in range(ctx, ctx + n):
                ids.append(tokens[seq][pos])
                positions.append(pos)
                slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            query_lens.append(n)
            context_lens.append(ctx)
            self.num_cached[seq] = ctx + n
        width = max(len(self.tables[seq]) for seq, _ in work) + 2  # padded like a runner's
        block_tables = np.zeros((len(work), width), dtype=np.int32)
        for row, (seq, _) in enumerate(work):
            block_tables[row, : len(self.tables[seq])] = self.tables[seq]
        meta = build_attention_metadata(
            np.array(query_lens, np.int32),
            np.array(context_lens, np.int32),
            block_tables,
            np.array(slots, np.int64),
            BLOCK_SIZE,
            CPU,
        )
        self.num_decode_groups.append(len(meta.decode_groups))
        with torch.inference_mode():
            hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(query_lens))


# Three sequences: (prompt length, decode steps). The schedule below covers a 2-chunk
# prefill, a prefill mixed with decodes, decodes of different lengths (padding mask)
# and a decode alongside a later chunk (context > 0) of another sequence.
SCHEDULE: list[list[tuple[int, int]]] = [
    [(0, 4), (1, 8)],  # first chunks, nothing cached
    [(0, 3), (1, 5)],  # second chunks: context 4 and 8
    [(0, 1), (1, 1), (2, 5)],  # two decodes + a whole prompt
    [(0, 1), (1, 1), (2, 1)],  # decodes only, lengths 9, 15, 6
    [(2, 1), (1, 3)],  # a decode + a 3-token chunk on top of 15 cached tokens
    [(0, 1), (1, 1), (2, 1)],
]


# One long sequence decoding beside short ones: the torch path attends to them in
# separate groups instead of padding the short ones to the long one's length.
SKEWED: list[list[tuple[int, int]]] = [
    [(0, 20), (1, 2), (2, 3), (3, 5)],
    [(1, 1), (2, 1), (3, 1), (0, 20)],  # decodes of 3, 4, 6 tokens + a chunk at context 20
    [(0, 1), (1, 1), (2, 1), (3, 1)],  # decodes of 41, 4, 5, 7 tokens: 11, 1, 2, 2 blocks
    [(0, 1), (1, 1), (2, 1), (3, 1)],
]


def _compare_with_transformers(
    model_dir: Path, schedule: list[list[tuple[int, int]]] = SCHEDULE
) -> PagedDriver:
    hf_config = load_hf_config(model_dir)
    ours = load_model(model_dir, hf_config, torch.float32, CPU)
    ref = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    num_seqs = 1 + max(seq for step in schedule for seq, _ in step)
    lengths = [
        sum(n for s, n in (w for step in schedule for w in step) if s == seq)
        for seq in range(num_seqs)
    ]
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        expected = [ref(torch.tensor([t])).logits[0] for t in tokens]

    driver = PagedDriver(ours)
    done = [0] * num_seqs
    for work in schedule:
        for (seq, n), logits in zip(work, driver.step(tokens, work), strict=True):
            torch.testing.assert_close(
                logits, expected[seq][done[seq] : done[seq] + n], atol=1e-4, rtol=1e-4
            )
            done[seq] += n
    assert done == lengths
    return driver


@pytest.mark.parametrize("kernel", [True, False], ids=["rust-kernel", "torch-path"])
def test_llama_untied_matches_transformers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kernel: bool
) -> None:
    if kernel:
        assert attention.can_use_native_decode(torch.zeros(1), torch.zeros(2, 1, 1, 1, 1))
    else:  # the path CUDA and non-float32 dtypes take
        monkeypatch.setattr(attention, "can_use_native_decode", lambda q, kv_cache: False)
    _compare_with_transformers(make_tiny_model(tmp_path / "m", "llama", "llama-2"))


def test_llama3_rope_tied_matches_transformers(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    path = make_tiny_model(
        tmp_path / "m",
        "llama",
        "llama-3-8b",
        tie_word_embeddings=True,
        head_dim=32,
        rope_scaling=rope,
    )
    assert load_hf_config(path).tie_word_embeddings
    _compare_with_transformers(path)


def test_qwen2_bias_matches_transformers(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", "qwen2", "qwen2.5", seed=3)
    _compare_with_transformers(path)


def test_sharded_checkpoint_loads_identically(tmp_path: Path) -> None:
    single = make_tiny_model(tmp_path / "single", seed=5)
    sharded = make_tiny_model(tmp_path / "sharded", seed=5, max_shard_size="300KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(single, load_hf_config(single), torch.float32, CPU).state_dict()
    b = load_model(sharded, load_hf_config(sharded), torch.float32, CPU).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_missing_directory_and_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_hf_config(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="config.json"):
        load_hf_config(tmp_path / "empty")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_hf_config(path)


def test_missing_weight_file(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", max_shard_size="300KB")
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError, match=shard.name):
        load_model(path, load_hf_config(path), torch.float32, CPU)
    single = make_tiny_model(tmp_path / "s")
    (single / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(single, load_hf_config(single), torch.float32, CPU)


def test_missing_tensor(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, load_hf_config(path), torch.float32, CPU)


def test_torch_decode_groups_skewed_lengths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention, "can_use_native_decode", lambda q, kv_cache: False)
    driver = _compare_with_transformers(make_tiny_model(tmp_path / "m", "llama", "llama-2"), SKEWED)
    assert max(driver.num_decode_groups) > 1, driver.num_decode_groups


@pytest.mark.parametrize(
    "blocks", [[11, 1, 2, 2], [1] * 7 + [64], [5, 5, 6], [1], [300, 1, 17, 2, 2, 40, 3]]
)
def test_decode_groups_bound_the_padding(blocks: list[int]) -> None:
    num_blocks = np.array(blocks)
    groups = attention.group_decodes(num_blocks)
    rows = [np.arange(len(blocks)) if g is None else g for g in groups]
    assert sorted(np.concatenate(rows).tolist()) == list(range(len(blocks)))
    padded = sum(len(r) * int(num_blocks[r].max()) for r in rows)
    assert padded <= 2 * num_blocks.sum()


def test_metadata_requires_decodes_first() -> None:
    with pytest.raises(ValueError, match="first"):
        build_attention_metadata(
            np.array([3, 1], np.int32),
            np.array([0, 4], np.int32),
            np.zeros((2, 2), np.int32),
            np.arange(4),
            BLOCK_SIZE,
            CPU,
        )
