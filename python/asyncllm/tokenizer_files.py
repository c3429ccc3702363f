"""Reading a model's tokenizer files without loading a tokenizer: a leaf module
that the front end (special tokens) and the engine core (the EOS ids it stops
on) both use, so the core needs nothing from the front end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncllm.errors import ModelLoadError


def read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; {} when the file is absent or not an object."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an
    AddedToken dict with its text under "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def resolve_eos_token_ids(
    model_dir: str | Path, tokenizer_dir: str | Path, hf_config: Any
) -> list[int]:
    """EOS ids from generation_config.json when present, else the model config,
    else the id of tokenizer_config.json's EOS token in tokenizer.json."""
    gen = read_json(Path(model_dir) / "generation_config.json")
    for value in (gen.get("eos_token_id"), getattr(hf_config, "eos_token_id", None)):
        ids = _as_id_list(value)
        if ids:
            return ids
    directory = Path(tokenizer_dir)
    eos = token_content(read_json(directory / "tokenizer_config.json").get("eos_token"))
    if eos is None or not (directory / "tokenizer.json").is_file():
        return []
    from tokenizers import Tokenizer  # only for this fallback

    try:
        eos_id = Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(eos)
    except Exception as exc:  # the library raises a bare Exception on bad files
        raise ModelLoadError(f"cannot load {directory / 'tokenizer.json'}: {exc}") from exc
    return [eos_id] if eos_id is not None else []


def _as_id_list(value: Any) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list | tuple):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
