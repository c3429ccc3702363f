"""EOS ids as the engine core reads them from a model's files, without loading
the front end's tokenizer: generation_config.json, then config.json, then the
tokenizer's EOS token."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

from asyncllm.tokenizer_files import resolve_eos_token_ids
from conftest import tokenizer_dir


def _tokenizer_copy(tmp_path: Path) -> Path:
    src = tokenizer_dir("llama-2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, tmp_path / name)
    return tmp_path


def test_generation_config_comes_first(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    assert resolve_eos_token_ids(tmp_path, tmp_path, SimpleNamespace(eos_token_id=2)) == [7, 9]


def test_model_config_next(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False}))
    assert resolve_eos_token_ids(tmp_path, tmp_path, SimpleNamespace(eos_token_id=5)) == [5]


def test_tokenizer_eos_token_last(tmp_path: Path) -> None:
    tok = _tokenizer_copy(tmp_path)
    # llama-2's "</s>" is id 2
    assert resolve_eos_token_ids(tmp_path, tok, SimpleNamespace()) == [2]


def test_nothing_to_stop_on(tmp_path: Path) -> None:
    assert resolve_eos_token_ids(tmp_path, tmp_path, SimpleNamespace(eos_token_id=None)) == []
