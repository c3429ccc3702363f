"""Exception classes users can catch.

Recoverable errors (a bad argument, an invalid request) are kept apart from fatal
ones (the engine is gone): the first fail one call and leave the engine serving,
the second fail everything that is waiting.
"""

from __future__ import annotations


class AsyncLLMError(Exception):
    """Base class of every error asyncllm raises on purpose."""


class ConfigError(AsyncLLMError, ValueError):
    """An engine or sampling argument is out of range; the message names the field."""


class ModelLoadError(AsyncLLMError, ValueError):
    """The model directory cannot be served: a file is missing or the architecture
    is not supported. The message says which and what is supported."""


class InvalidRequestError(AsyncLLMError, ValueError):
    """One request cannot be served (for example its prompt is longer than
    `max_model_len`); other requests are unaffected."""


class EngineDeadError(AsyncLLMError, RuntimeError):
    """The engine core has died; every waiting and every new request fails with this."""


class EngineStartupError(AsyncLLMError, RuntimeError):
    """The engine core could not start; the message carries its root cause."""


class OutputProcessingError(AsyncLLMError, RuntimeError):
    """The front end could not turn this request's outputs into a RequestOutput
    (a bug in output processing); that request failed, the engine serves on."""
