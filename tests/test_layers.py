"""The package imports downward only: server -> frontend -> engine -> executor ->
core/worker -> models, and the top-level leaf modules (messages, config, tokenizer_files, errors,
...) import nothing but other leaves. Checked on the source, lazy and
TYPE_CHECKING imports included, so an upward import cannot hide in a function."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncllm

RANKS = {
    "server": 6,
    "frontend": 5,
    "engine": 4,
    "executor": 3,
    "core": 2,
    "worker": 2,
    "models": 1,
}
# The one sideways import allowed: the runners read the scheduler's plan.
SIDEWAYS = {("worker", "core")}
PACKAGE = Path(asyncllm.__file__).parent


def _imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "asyncllm":
                found += [f"asyncllm.{a.name}" for a in node.names]
            elif node.module.startswith("asyncllm."):
                found.append(node.module)
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.startswith("asyncllm.")]
    return found


def _part(module: str) -> str:
    """The layer of a module: its layer's subpackage, or "" for a leaf."""
    top = module.split(".")[1]
    return top if top in RANKS else ""


def test_no_module_imports_upward() -> None:
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        if rel.parts == ("asyncllm", "__init__"):
            continue  # the package root re-exports the public API
        module = ".".join(rel.parts)
        source = _part(module)
        for target in _imports(path):
            dest = _part(target)
            if dest == source or (source, dest) in SIDEWAYS:
                continue
            if dest and (not source or RANKS[dest] >= RANKS[source]):
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)
