"""Which GGUF files a model argument names: a `.gguf` file, split files
(`name-00001-of-00003.gguf`: any one of them names the set), or a folder that
holds one model's GGUF (one file or one split set)."""

from __future__ import annotations

import re
from pathlib import Path

from asyncllm.errors import ModelLoadError

SUFFIX = ".gguf"
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


def names_gguf(model: str | Path) -> bool:
    """Whether `model` is a GGUF file, or a folder without config.json that holds
    GGUF files (a Hugging Face directory keeps its meaning)."""
    path = Path(model)
    if path.is_file():
        return path.suffix == SUFFIX
    if path.is_dir() and not (path / "config.json").is_file():
        return any(path.glob(f"*{SUFFIX}"))
    return False


def gguf_files(model: str | Path) -> list[Path]:
    """The GGUF files of one model, the first split first; ModelLoadError naming
    what is missing or ambiguous."""
    path = Path(model)
    if path.is_dir():
        found = sorted(path.glob(f"*{SUFFIX}"))
        stems = {_stem(p) for p in found}
        if len(stems) != 1:
            raise ModelLoadError(
                f"{path} holds {len(stems)} GGUF models ({', '.join(sorted(stems))}); "
                "name the file to load"
            )
        path = found[0]
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {str(path)!r} does not exist")
    split = _SPLIT.match(path.name)
    if split is None:
        return [path.resolve()]
    count = int(split.group("count"))
    files = [
        path.with_name(f"{split.group('stem')}-{i:05d}-of-{count:05d}{SUFFIX}")
        for i in range(1, count + 1)
    ]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"split GGUF {path.name}: missing {', '.join(missing)}")
    return [f.resolve() for f in files]


def _stem(path: Path) -> str:
    """The name a file shares with its splits (its own name when it is not one)."""
    split = _SPLIT.match(path.name)
    return split.group("stem") if split else path.name
