"""Tool-call parsers, pluggable by name (`asyncllm serve --tool-call-parser NAME`):
each turns a model's text into content and OpenAI `tool_calls`, whole or as
streamed deltas. `hermes` reads the `<tool_call>{...}</tool_call>` blocks of
Hermes and Qwen models, `llama3_json` the bare JSON calls of Llama 3.x,
`pythonic` lists of Python calls (`[f(x=1), g()]`), `mistral` the calls after
Mistral's `[TOOL_CALLS]`, `qwen3_coder` Qwen3-Coder's
`<tool_call><function=NAME><parameter=KEY>` blocks; `forced`
holds the parsers for output constrained by `tool_choice` "required" or a named
function."""

from __future__ import annotations

from asyncllm.errors import ConfigError
from asyncllm.server.tool_parsers.base import (
    ExtractedToolCalls,
    ParserDelta,
    ToolCall,
    ToolCallDelta,
    ToolParser,
)
from asyncllm.server.tool_parsers.hermes import HermesToolParser
from asyncllm.server.tool_parsers.llama3_json import Llama3JsonToolParser
from asyncllm.server.tool_parsers.mistral import MistralToolParser
from asyncllm.server.tool_parsers.pythonic import PythonicToolParser
from asyncllm.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

DEFAULT_TOOL_PARSER = "hermes"
_REGISTRY: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Make `cls` available under `cls.name` (usable as a class decorator)."""
    _REGISTRY[cls.name] = cls
    return cls


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ConfigError listing the known ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(tool_parser_names())
        message = f"--tool-call-parser {name!r} is unknown: known parsers: {known}"
        raise ConfigError(message) from None


register(HermesToolParser)
register(Llama3JsonToolParser)
register(MistralToolParser)
register(PythonicToolParser)
register(Qwen3CoderToolParser)

__all__ = [
    "DEFAULT_TOOL_PARSER",
    "ExtractedToolCalls",
    "ParserDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "get_tool_parser",
    "register",
    "tool_parser_names",
]
