"""The `.pyi` stub of the native module matches the built module."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import asyncllm
from asyncllm import _core


def test_native_module_matches_package_version():
    assert _core.native_version() == asyncllm.__version__
    assert isinstance(_core.wire_version(), int)


def test_stub_matches_built_module(tmp_path):
    # The extension and its stub alone, in a package with an empty __init__: stubtest
    # then analyses the stub (and numpy, which it names), not the whole of asyncllm
    # and torch behind its __init__ (~50 s cold against ~8 s).
    package = tmp_path / "asyncllm"
    package.mkdir()
    (package / "__init__.py").write_text("")
    built = Path(_core.__file__)
    (package / built.name).symlink_to(built)
    (package / "_core.pyi").symlink_to(built.parent / "_core.pyi")
    env = dict(os.environ, PYTHONPATH=str(tmp_path), MYPYPATH=str(tmp_path))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy.stubtest",
            "asyncllm._core",
            # PyO3 sets __all__ at runtime; listing it again in the stub only drifts.
            "--allowlist",
            str(Path(__file__).parent / "stubtest_allowlist.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
        env=env,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "checked 1 module" in result.stdout or "no issues found in 1 module" in result.stdout
