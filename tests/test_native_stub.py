"""The `.pyi` stub of the native module matches the built module."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import asyncllm
from asyncllm import _core


def test_native_module_matches_package_version():
    assert _core.native_version() == asyncllm.__version__
    assert isinstance(_core.wire_version(), int)


def test_stub_matches_built_module():
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
    )
    assert result.returncode == 0, result.stdout + result.stderr
