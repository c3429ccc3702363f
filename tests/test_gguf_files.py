"""Finding a GGUF model's files and reading its config from the metadata
(asyncllm.gguf_files), on files and metadata made here."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncllm.errors import ModelLoadError
from asyncllm.gguf_files import gguf_files, names_gguf
from asyncllm.gguf_files.metadata import hf_config_from_metadata


def _touch(folder: Path, *names: str) -> list[Path]:
    for name in names:
        (folder / name).write_bytes(b"GGUF")
    return [folder / n for n in names]


def test_a_file_a_folder_and_split_files(tmp_path: Path) -> None:
    (one,) = _touch(tmp_path, "m.gguf")
    assert names_gguf(one) and names_gguf(tmp_path)
    assert gguf_files(one) == gguf_files(tmp_path) == [one.resolve()]
    split = tmp_path / "split"
    split.mkdir()
    parts = _touch(split, *(f"big-{i:05d}-of-00003.gguf" for i in (1, 2, 3)))
    assert gguf_files(parts[1]) == gguf_files(split) == [p.resolve() for p in parts]
    parts[2].unlink()
    with pytest.raises(ModelLoadError, match="missing big-00003-of-00003.gguf"):
        gguf_files(split)


def test_what_is_not_a_gguf_model(tmp_path: Path) -> None:
    _touch(tmp_path, "m.gguf", "config.json")
    assert not names_gguf(tmp_path)  # a Hugging Face directory keeps its meaning
    assert not names_gguf(tmp_path / "config.json")
    assert not names_gguf(tmp_path / "absent.gguf")
    two = tmp_path / "two"
    two.mkdir()
    _touch(two, "a.gguf", "b.gguf")
    with pytest.raises(ModelLoadError, match="holds 2 GGUF models"):
        gguf_files(two)


def _llama_fields(arch: str = "llama") -> dict[str, object]:
    return {
        "general.architecture": arch,
        f"{arch}.context_length": 2048,
        f"{arch}.block_count": 4,
        f"{arch}.feed_forward_length": 256,
        f"{arch}.embedding_length": 128,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.head_count_kv": 2,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": 32,
        "tokenizer.ggml.tokens": ["a"] * 300,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def test_llama_config_from_metadata() -> None:
    config = hf_config_from_metadata(_llama_fields(), {"token_embd.weight", "output.weight"})
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == (4, 128, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["vocab_size"] == 300  # no llama.vocab_size: the tokenizer's length
    assert config["tie_word_embeddings"] is False
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tied = hf_config_from_metadata(_llama_fields(), {"token_embd.weight"})
    assert tied["tie_word_embeddings"] is True


def test_other_families_map_their_keys() -> None:
    fields = _llama_fields("qwen3")
    fields["qwen3.attention.key_length"] = 64
    config = hf_config_from_metadata(fields, set())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["head_dim"] == 64
    fields = _llama_fields("gemma2")
    fields["gemma2.attn_logit_softcapping"] = 50.0
    fields["gemma2.attention.sliding_window"] = 4096
    config = hf_config_from_metadata(fields, set())
    assert config["attn_logit_softcapping"] == 50.0 and config["sliding_window"] == 4096
    assert config["query_pre_attn_scalar"] == 32


def test_unsupported_metadata_is_an_error_naming_it() -> None:
    with pytest.raises(ModelLoadError, match="GGUF architecture 'mamba' is not supported"):
        hf_config_from_metadata(_llama_fields("mamba"), set())
    fields = _llama_fields()
    fields["llama.rope.scaling.type"] = "yarn"
    with pytest.raises(ModelLoadError, match="rope.scaling.type 'yarn'"):
        hf_config_from_metadata(fields, set())
    with pytest.raises(ModelLoadError, match="rope_freqs.weight"):
        hf_config_from_metadata(_llama_fields(), {"rope_freqs.weight"})
