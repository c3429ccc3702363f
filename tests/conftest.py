"""Shared fixtures: where the real tokenizer assets live, and skipping without them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = Path(os.environ.get("ASYNCLLM_ASSETS", REPO_ROOT.parent / "shared" / "assets"))
TOKENIZERS_DIR = ASSETS_DIR / "tokenizers"


def tokenizer_dir(name: str) -> Path:
    """The directory of one real tokenizer under shared/assets, or skip the test."""
    path = TOKENIZERS_DIR / name
    if not (path / "tokenizer.json").is_file():
        pytest.skip(f"tokenizer assets not found at {path} (set ASYNCLLM_ASSETS)")
    return path
