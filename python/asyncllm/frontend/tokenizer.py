"""Loading a model's tokenizer: `tokenizer.json` for the vocabulary, special tokens
from `tokenizer_config.json`, and the EOS ids the engine stops on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from asyncllm.errors import ModelLoadError


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class Tokenizer:
    """A thin wrapper over the `tokenizers` library with the model's special tokens."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.path = self.directory / "tokenizer.json"
        if not self.path.is_file():
            raise ModelLoadError(
                f"no tokenizer.json in {self.directory}: asyncllm needs a fast-tokenizer file "
                "(set EngineArgs.tokenizer to a directory that has one)"
            )
        try:
            self._tok = HFTokenizer.from_file(str(self.path))
        except Exception as exc:  # the library raises a bare Exception on bad files
            raise ModelLoadError(f"cannot load {self.path}: {exc}") from exc
        self.config = _read_json(self.directory / "tokenizer_config.json")
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token_id = self.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """`encode` of several texts. The library releases the GIL here (not in
        `encode`), so a long text tokenized on a worker thread leaves the event
        loop running."""
        encodings = self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)


def resolve_eos_token_ids(model_dir: str | Path, hf_config: Any, tokenizer: Tokenizer) -> list[int]:
    """EOS ids from generation_config.json when present, else the model config,
    else the tokenizer's EOS token."""
    gen = _read_json(Path(model_dir) / "generation_config.json")
    for value in (gen.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        ids = _as_id_list(value)
        if ids:
            return ids
    return [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
