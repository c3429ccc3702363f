"""The package imports downward only: cli -> server -> frontend -> engine -> executor ->
core/worker -> lora -> models, and the top-level leaf modules (messages, config,
tokenizer_files, errors, ...) import nothing but other leaves; and no two modules
import each other, directly or around a circle. Checked on the source, lazy and
TYPE_CHECKING imports included, so an upward or circular import cannot hide in a
function."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncllm

RANKS = {
    "cli": 8,
    "server": 7,
    "frontend": 6,
    "engine": 5,
    "executor": 4,
    "core": 3,
    "worker": 3,
    "lora": 2,
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


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _module_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules `path` imports: `from a.b import c` names a.b.c when c
    is a module, else a.b. The package root is left out: it re-exports the public
    API, lazily, and every import of a submodule runs it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asyncllm"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    found.discard("asyncllm")
    return found & modules.keys()  # the compiled `_core` is no module of ours


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's
    algorithm, iterative): each is a set of modules that import each other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    circles.append(sorted(component))
    return circles


def test_no_import_circle() -> None:
    modules = _modules()
    graph = {name: _module_imports(path, modules) - {name} for name, path in modules.items()}
    circles = _circles(graph)
    assert not circles, "modules that import each other:\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_circle_finder_sees_a_circle() -> None:
    """The finder itself: a three-module circle beside a chain, and a self-import ignored."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _circles(graph) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []
