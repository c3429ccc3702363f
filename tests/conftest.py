"""Shared fixtures: where the real tokenizer assets live, and skipping without them."""

from __future__ import annotations

import importlib.util
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


def _fetch_script():
    script = REPO_ROOT / "tools" / "fetch_smollm2.py"
    spec = importlib.util.spec_from_file_location("fetch_smollm2", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (a real trained model) as `tools/fetch_smollm2.py`
    puts it in the cache (CI runs the script first), or skip. Only the size is
    checked here: the script checked the digest when it put the file there."""
    fetch = _fetch_script()
    path = fetch.target_path()
    if not path.is_file() or path.stat().st_size != fetch.SIZE:
        pytest.skip(f"SmolLM2 GGUF not found at {path} (run tools/fetch_smollm2.py)")
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["serial", "overlap"])
def scheduling_mode(request):
    """Runs the tests that use it with and without overlap scheduling: engines
    built meanwhile (in this process or a core process) take their default
    `async_scheduling` from ASYNCLLM_ASYNC_SCHEDULING. Module-scoped, so module
    engine fixtures that request it are built once per mode."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCLLM_ASYNC_SCHEDULING", "1" if request.param else "0")
        yield request.param


@pytest.fixture
def fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token count of every fused decode call of the test (the list fills)."""
    from asyncllm.models.fused_decode import FusedDecode

    tokens: list[int] = []
    original = FusedDecode.__call__

    def counting(self, hidden, positions, meta):  # type: ignore[no-untyped-def]
        tokens.append(meta.num_tokens)
        return original(self, hidden, positions, meta)

    monkeypatch.setattr(FusedDecode, "__call__", counting)
    return tokens
