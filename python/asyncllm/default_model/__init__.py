"""`asyncllm-tiny`, the model asyncllm ships so that it generates text offline out of the box.

It is trained from the Python standard library's source by
`tools/train_default_model.py`; its model card is the README.md beside it. A model
argument that names an existing directory always means that directory; otherwise the
name `asyncllm-tiny` (the default) means this one.
"""

from __future__ import annotations

import logging
from pathlib import Path

DEFAULT_MODEL = "asyncllm-tiny"
_DIRECTORY = Path(__file__).resolve().parent / DEFAULT_MODEL

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """Where the shipped model's Hugging Face directory is installed."""
    return _DIRECTORY


def resolve_model(model: str) -> str:
    """The directory a model argument means: the built-in model for its name (unless a
    directory of that name exists); for a GGUF file (or a folder of one), the folder
    prepared from its metadata (`asyncllm.gguf_files`); else the argument itself."""
    from asyncllm.gguf_files import names_gguf, prepare_gguf

    if names_gguf(model):
        return str(prepare_gguf(model))
    if model != DEFAULT_MODEL or Path(model).is_dir():
        return model
    logger.info("model %r: asyncllm's built-in default model, at %s", DEFAULT_MODEL, _DIRECTORY)
    return str(_DIRECTORY)
