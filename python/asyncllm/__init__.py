"""asyncllm: an LLM inference engine whose per-step CPU work runs off the GIL."""

from asyncllm._core import native_version as _native_version
from asyncllm.config import EngineArgs
from asyncllm.errors import (
    AsyncLLMError,
    ConfigError,
    EngineDeadError,
    EngineStartupError,
    InvalidRequestError,
    ModelLoadError,
    OutputProcessingError,
)
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.structured_output.params import StructuredOutputsParams

__version__ = "0.1.0"

if _native_version() != __version__:  # pragma: no cover - a packaging error
    raise ImportError(
        f"asyncllm {__version__} found native module asyncllm._core {_native_version()}; "
        "reinstall the package so both come from the same build"
    )


def __getattr__(name: str) -> object:
    # The engines pull in torch; load them on first use so that importing
    # asyncllm (for SamplingParams, say) stays cheap.
    if name == "LLM":
        from asyncllm.frontend.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from asyncllm.frontend.async_llm import AsyncLLM

        return AsyncLLM
    raise AttributeError(f"module 'asyncllm' has no attribute {name!r}")


__all__ = [
    "LLM",
    "AsyncLLM",
    "AsyncLLMError",
    "CompletionOutput",
    "ConfigError",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "EngineArgs",
    "EngineDeadError",
    "EngineStartupError",
    "InvalidRequestError",
    "Logprob",
    "LoRARequest",
    "ModelLoadError",
    "OutputProcessingError",
    "PoolingParams",
    "RequestOutput",
    "RequestOutputKind",
    "SamplingParams",
    "StructuredOutputsParams",
]
