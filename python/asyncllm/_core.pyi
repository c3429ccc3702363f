"""Stub of the native module `asyncllm._core` (checked against the build by
`tests/test_native_stub.py`)."""

def native_version() -> str:
    """Version of the native module; equals `asyncllm.__version__`."""

def wire_version() -> int:
    """Version byte of the wire schema this build speaks."""

class WireError(ValueError):
    """A frame could not be decoded or a message could not be encoded."""

class DetokenizerError(ValueError):
    """The detokenizer was given something it cannot work with."""

# --- codec (rust/py/codec.rs) ---

# --- detokenizer (rust/py/detok.rs) ---
