"""asyncllm: an LLM inference engine whose per-step CPU work runs off the GIL."""

from asyncllm._core import native_version as _native_version

__version__ = "0.1.0"

if _native_version() != __version__:  # pragma: no cover - a packaging error
    raise ImportError(
        f"asyncllm {__version__} found native module asyncllm._core {_native_version()}; "
        "reinstall the package so both come from the same build"
    )
