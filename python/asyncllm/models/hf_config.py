"""Reading a model directory's config.json, with errors that say what is wrong."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoConfig, PretrainedConfig

from asyncllm.errors import ModelLoadError
from asyncllm.models.registry import check_architecture


def load_hf_config(model_dir: str | Path) -> PretrainedConfig:
    """The transformers config of a local model directory.

    The directory, config.json and the architecture are checked here first, so the
    user sees which of them is wrong rather than a transformers traceback (which may
    also try to reach the Hub).
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model directory {str(path)!r} does not exist")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"model directory {str(path)!r} has no config.json")
    try:
        raw = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from e
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{config_file} is not a JSON object")
    check_architecture(raw.get("architectures"))
    try:
        return AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises many kinds; all mean "cannot load"
        raise ModelLoadError(f"cannot parse {config_file}: {e}") from e
