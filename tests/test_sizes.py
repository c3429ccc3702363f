"""Modules and functions stay small enough to read at once (STYLE.md; issue 26's
targets): no module of the package past 500 lines, no function past 80. Checked on
the source, so a long function added by a merge fails here, not in review."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncllm

PACKAGE = Path(asyncllm.__file__).parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_past_500_lines() -> None:
    long = {
        str(p.relative_to(PACKAGE)): n
        for p in _sources()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_MODULE_LINES
    }
    assert not long, f"modules over {MAX_MODULE_LINES} lines: {long}"


def test_no_function_past_80_lines() -> None:
    long = {}
    for path in _sources():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (node.end_lineno or node.lineno) - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"


def test_the_checks_see_the_package() -> None:
    """The two checks above read the real source tree (a wrong root passes them)."""
    assert len(_sources()) > 100
    assert (PACKAGE / "engine" / "core.py").exists()
