"""Every architecture against transformers: random-weight tiny models (hidden 64,
2 layers) with the llama-2 tokenizer. fp32 logits within 1e-4 through a paged
schedule (chunked prefill, mixed decodes, prompts past the sliding window where
there is one); greedy ids equal to transformers `generate` through the engine with
chunked prefill and prefix-cache hits; one bf16 run per family."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from test_models import SCHEDULE, SKEWED, PagedDriver
from tokenizers import Tokenizer

from asyncllm import LLM, SamplingParams
from asyncllm.models import attention
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from conftest import tokenizer_dir
from tiny_models import TINY_DEFAULTS, TOKENIZER_FILES, _special_token_ids, hf_greedy

WINDOW = 6  # sliding window of the windowed configs: shorter than every long prompt

# name -> (transformers model class, config class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {}),
    "qwen3-window": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(sliding_window=WINDOW)),
    "phi3": (
        "Phi3ForCausalLM",
        "Phi3Config",
        dict(
            partial_rotary_factor=0.5,
            pad_token_id=0,
            original_max_position_embeddings=256,  # < max_position_embeddings: scaled
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.5, 2.0, 3.0],
                "long_factor": [2.0, 4.0, 8.0, 16.0],
                "original_max_position_embeddings": 256,
            },
        ),
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
    ),
    "qwen2-moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
            norm_topk_prob=False,
            mlp_only_layers=[1],
        ),
    ),
    "qwen3-moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    ),
    "gemma2": (
        "Gemma2ForCausalLM",
        "Gemma2Config",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        "Gemma3ForCausalLM",
        "Gemma3TextConfig",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1_000_000.0,
                },
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
}


def make_family_model(
    path: Path,
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    **overrides: Any,
) -> Path:
    """Save a tiny random-weight `family` model with the llama-2 tokenizer, its
    weights in `dtype`, sharded when `max_shard_size` is given. Norm weights are
    perturbed too (transformers initialises them to a constant, which would hide a
    norm applied in the wrong place)."""
    model_name, config_name, family_overrides = FAMILIES[family]
    path.mkdir(parents=True, exist_ok=True)
    tok_dir = tokenizer_dir("llama-2")
    for name in TOKENIZER_FILES:
        if (tok_dir / name).is_file():
            shutil.copy(tok_dir / name, path / name)
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    settings = dict(TINY_DEFAULTS, vocab_size=tok.get_vocab_size(with_added_tokens=True))
    settings.update(_special_token_ids(tok, tok_dir))
    settings.update(family_overrides)
    settings.update(overrides)
    config = getattr(transformers, config_name)(**settings)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn(param.shape, generator=gen) * 0.2)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.to(dtype).save_pretrained(path, **kwargs)
    if (tok_dir / "generation_config.json").is_file():  # save_pretrained wrote its own
        shutil.copy(tok_dir / "generation_config.json", path / "generation_config.json")
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_family_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def reference(family_dir: Path) -> torch.nn.Module:
    """transformers' fp32 model of the family (eager attention: soft-capping)."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        family_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def _skip_window_variants(family_dir: Path) -> None:
    """The *-window variants differ from their family only in attention, which the
    logits test covers (and test_sliding_window runs Mistral's through the engine)."""
    if family_dir.name.rstrip("0123456789").endswith("-window"):
        pytest.skip("attention-only variant: covered by the logits test")


def _check_schedule(
    ours: torch.nn.Module, ref: torch.nn.Module, schedule: list[list[tuple[int, int]]]
) -> None:
    """Run `schedule` through our paged model; every row of logits within 1e-4 of
    transformers' full forward over the same sequence."""
    num_seqs = 1 + max(seq for step in schedule for seq, _ in step)
    lengths = [sum(n for step in schedule for s, n in step if s == seq) for seq in range(num_seqs)]
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, ours.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        expected = [ref(torch.tensor([t])).logits[0] for t in tokens]
    driver = PagedDriver(ours)
    done = [0] * num_seqs
    for work in schedule:
        for (seq, n), logits in zip(work, driver.step(tokens, work), strict=True):
            want = expected[seq][done[seq] : done[seq] + n]
            torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)
            done[seq] += n


def test_logits_match_transformers(
    family_dir: Path, reference: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SCHEDULE: chunked prefill, prefills beside decodes; SKEWED: a 40-token prompt
    and decodes past it, far past the sliding window of the windowed families;
    SKEWED again on the torch decode path (the one CUDA and half precision take)."""
    ours = load_model(family_dir, load_hf_config(family_dir), torch.float32, torch.device("cpu"))
    ref = reference
    _check_schedule(ours, ref, SCHEDULE)
    _check_schedule(ours, ref, SKEWED)
    monkeypatch.setattr(attention, "can_use_native_decode", lambda q, kv_cache: False)
    _check_schedule(ours, ref, SKEWED)


def test_greedy_matches_generate_with_chunks_and_prefix_hits(
    family_dir: Path, reference: torch.nn.Module
) -> None:
    _skip_window_variants(family_dir)
    vocab = load_hf_config(family_dir).vocab_size
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (16,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 9)]
    expected = hf_greedy(family_dir, prompts, 10, reference)
    llm = LLM(
        str(family_dir),
        multiprocess=False,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert llm.engine.core.stats().prefix_cache_hits == 16  # the shared 4 blocks


# bf16 against transformers' bf16: both round differently (fused projections,
# another summation order), so logits agree to about one bf16 step of their size.
BF16_ATOL = 0.1


def test_bf16_close_to_transformers_bf16(family_dir: Path) -> None:
    _skip_window_variants(family_dir)
    hf_config = load_hf_config(family_dir)
    ours = load_model(family_dir, hf_config, torch.bfloat16, torch.device("cpu"))
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        family_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(3, hf_config.vocab_size, (12,), generator=gen).tolist()]
    with torch.no_grad():
        expected = ref(torch.tensor(tokens)).logits[0].float()
    driver = PagedDriver(ours)
    driver.kv_caches = [c.to(torch.bfloat16) for c in driver.kv_caches]
    steps = [[(0, 8)], [(0, 1)], [(0, 3)]]  # a prefill, a decode, a chunk on top
    got = torch.cat([logits for work in steps for logits in driver.step(tokens, work)])
    scale = expected.abs().max().item()
    assert (got - expected).abs().max().item() <= BF16_ATOL * max(scale, 1.0)


@pytest.mark.parametrize(
    ("family", "dtype", "tied"),
    [("qwen3", torch.bfloat16, True), ("phi3", torch.float16, False)],
    ids=["qwen3-bf16-tied", "phi3-fp16-untied"],
)
def test_half_sharded_checkpoints_load(
    tmp_path: Path, family: str, dtype: torch.dtype, tied: bool
) -> None:
    """A bf16 / fp16 checkpoint in shards (with an index) loads into an fp32 model
    equal to transformers loading the same files; tied embeddings read no lm_head."""
    path = make_family_model(
        tmp_path / "m", family, dtype=dtype, max_shard_size="2MB", tie_word_embeddings=tied
    )
    assert (path / "model.safetensors.index.json").is_file()
    hf_config = load_hf_config(path)
    assert hf_config.tie_word_embeddings is tied
    ours = load_model(path, hf_config, torch.float32, torch.device("cpu"))
    assert (ours.lm_head is None) is tied
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    _check_schedule(ours, ref, SCHEDULE)


def test_unknown_architecture_lists_every_family(tmp_path: Path) -> None:
    from asyncllm.errors import ModelLoadError

    path = make_family_model(tmp_path / "m", "qwen3")
    config = path / "config.json"
    config.write_text(config.read_text().replace("Qwen3ForCausalLM", "FalconForCausalLM"))
    with pytest.raises(ModelLoadError, match="FalconForCausalLM") as err:
        load_hf_config(path)
    for arch in {name for name, _, _ in FAMILIES.values()}:
        assert arch in str(err.value)


def test_longrope_tables_match_transformers() -> None:
    """Phi-3's longrope: below original_max_position_embeddings the short factors,
    from there on the long ones, and the long ones everywhere for a sequence whose
    prompt is longer (transformers switches a whole pass once it is past that
    length), both times the attention factor, on the rotary half."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from asyncllm.models.layers import rope_parameters
    from asyncllm.models.phi3 import LongRopeEmbedding

    _, config_name, overrides = FAMILIES["phi3"]
    config = getattr(transformers, config_name)(**dict(TINY_DEFAULTS, vocab_size=64, **overrides))
    params = rope_parameters(config)
    original = params["original_max_position_embeddings"]
    assert original == 256 < config.max_position_embeddings  # attention factor > 1
    rotary_dim = config.head_dim // 2  # partial_rotary_factor 0.5
    rotary = LongRopeEmbedding(rotary_dim, config.max_position_embeddings, params, original)
    rotary.init_cache(torch.float32, torch.device("cpu"))
    long_prompt = np.array([original + 1])
    for seq_len, positions, prompt_lens in (
        (original, range(0, original), np.array([original])),
        (original + 1, range(original, 1024), np.array([original])),
        (original + 1, range(0, 1024), long_prompt),  # a long prompt: long from the start
    ):
        inv_freq, factor = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=seq_len)
        pos = torch.tensor(list(positions))
        freqs = torch.outer(pos.float(), inv_freq)
        rows = rotary.table_positions(pos, prompt_lens, np.array([len(pos)]))
        cos, sin = rotary.cos_sin(rows)
        torch.testing.assert_close(cos[:, 0], freqs.cos() * factor)
        torch.testing.assert_close(sin[:, 0], freqs.sin() * factor)


def test_longrope_past_the_original_length_matches_generate(tmp_path: Path) -> None:
    """Phi-3 with original_max_position_embeddings 16, through the engine with
    chunked prefill and the prefix cache: a prompt longer than 16 (rotated with
    the long factors from its first token, as transformers' first pass does), a
    short one generated up to 16 (short factors throughout), and a long prompt
    that starts with the short one's first block, which must not take it from the
    prefix cache; greedy ids equal transformers `generate` for each."""
    rope = dict(FAMILIES["phi3"][2]["rope_parameters"], original_max_position_embeddings=16)
    path = make_family_model(
        tmp_path / "m", "phi3", original_max_position_embeddings=16, rope_parameters=rope
    )
    hf_config = load_hf_config(path)
    g = torch.Generator().manual_seed(7)
    short = torch.randint(3, hf_config.vocab_size, (4,), generator=g).tolist()
    long = torch.randint(3, hf_config.vocab_size, (24,), generator=g).tolist()
    long_on_short = short + torch.randint(3, hf_config.vocab_size, (20,), generator=g).tolist()
    prompts = [short, long, long_on_short]
    expected = hf_greedy(path, prompts, 12)
    llm = LLM(
        str(path),
        multiprocess=False,
        dtype="float32",
        block_size=4,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert llm.engine.core.stats().prefix_cache_hits == 0  # not the short prompt's block
