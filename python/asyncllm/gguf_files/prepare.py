"""A GGUF model as the Hugging Face directory the rest of the engine reads.

The front end reads `tokenizer.json`, `tokenizer_config.json` and the chat template
from a model directory, the engine core `config.json` and the EOS ids. For a GGUF
they are made once from its metadata and kept in a cache folder
(`$XDG_CACHE_HOME/asyncllm/gguf/<name>-<key>/`, the key from the files' paths,
sizes and modification times) together with `gguf.json`, the files and a table of
their tensors (name, type, shape, byte offset). The weights stay in the GGUF: the
loader (`asyncllm.models.gguf`) maps them from there, using the table so that no
start pays for parsing the metadata again (gguf-py's reader takes seconds on a
vocabulary of 50k tokens).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from asyncllm.errors import ModelLoadError
from asyncllm.gguf_files.locate import gguf_files
from asyncllm.gguf_files.metadata import hf_config_from_metadata

logger = logging.getLogger(__name__)

MANIFEST = "gguf.json"
FORMAT = 1  # bump when what is written here changes: old folders are made again


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncllm" / "gguf"


def is_prepared(model_dir: str | Path) -> bool:
    """Whether `model_dir` is a folder made by `prepare_gguf` (the loader's switch)."""
    return (Path(model_dir) / MANIFEST).is_file()


def read_manifest(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / MANIFEST
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelLoadError(f"{path} is not a GGUF manifest of format {FORMAT}")
    return data


def prepare_gguf(model: str | Path) -> Path:
    """The prepared folder of the GGUF model `model` names (made when absent)."""
    files = gguf_files(model)
    stamp = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    key = hashlib.sha256(json.dumps([FORMAT, stamp]).encode()).hexdigest()[:16]
    target = cache_root() / f"{files[0].stem}-{key}"
    if is_prepared(target):
        return target
    logger.info("GGUF %s: reading its metadata and tokenizer into %s", files[0], target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".prepare-"))
    try:
        _write_folder(files, tmp)
        try:
            os.rename(tmp, target)
        except OSError:  # made meanwhile by another process: theirs is the same
            if not is_prepared(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _write_folder(files: list[Path], folder: Path) -> None:
    from gguf import GGUFReader

    readers = [GGUFReader(f) for f in files]
    fields = {name: field.contents() for name, field in readers[0].fields.items()}
    tensors = [
        {
            "name": t.name,
            "type": t.tensor_type.name,
            "shape": [int(d) for d in reversed(t.shape.tolist())],
            "file": i,
            "offset": int(t.data_offset),
            "nbytes": int(t.n_bytes),
        }
        for i, reader in enumerate(readers)
        for t in reader.tensors
    ]
    config = hf_config_from_metadata(fields, {str(t["name"]) for t in tensors})
    _write_json(folder / "config.json", config)
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(folder / "generation_config.json", generation)
    _write_tokenizer(files[0], folder)
    manifest = {"format": FORMAT, "files": [str(f) for f in files], "tensors": tensors}
    _write_json(folder / MANIFEST, manifest)  # last: its presence means "complete"


def _write_tokenizer(file: Path, folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and the chat template, as transformers'
    GGUF tokenizer conversion makes them (its special tokens and add-BOS flag
    come from the metadata)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    except Exception as exc:  # transformers raises many kinds for an odd tokenizer
        raise ModelLoadError(f"cannot convert the tokenizer of {file}: {exc}") from exc
    tok.save_pretrained(str(folder))


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, default=_plain), encoding="utf-8")


def _plain(value: Any) -> Any:
    """numpy scalars and arrays in metadata values as JSON numbers and lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON")
