"""Reasoning parsers, by name (`asyncllm serve --reasoning-parser NAME`): each
splits a reasoning model's output into its reasoning (`reasoning_content` in
chat, reasoning items in Responses, thinking blocks in Messages) and its
answer, which tool parsers and clients then read."""

from __future__ import annotations

from asyncllm.errors import ConfigError
from asyncllm.server.reasoning.base import ReasoningDelta, ReasoningParser
from asyncllm.server.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

_REGISTRY: dict[str, type[ReasoningParser]] = {
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def reasoning_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reasoning_parser(name: str | None) -> type[ReasoningParser] | None:
    """The parser class registered as `name` (None: no reasoning parser);
    ConfigError listing the known ones."""
    if not name:
        return None
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(reasoning_parser_names())
        raise ConfigError(
            f"--reasoning-parser {name!r} is unknown: known parsers: {known}"
        ) from None


__all__ = ["ReasoningDelta", "ReasoningParser", "get_reasoning_parser", "reasoning_parser_names"]
