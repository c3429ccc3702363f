"""What every tool-call parser produces: the model's text split into content and
OpenAI tool calls, streamed as deltas or collected whole.

A parser is made per choice and fed that choice's text deltas in order (`feed`),
then `finish` once. The non-streamed result is the same machine fed the whole text
at once (`extract`), so a streamed reply reassembles to the non-streamed one.
"""

from __future__ import annotations

import secrets
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

# Bounds on what one choice's output may turn into.
MAX_TOOL_CALLS = 64  # calls in one message; further blocks stay content
MAX_CALL_CHARS = 256 * 1024  # characters of one call (name and arguments)


def new_call_id() -> str:
    """An OpenAI-style tool call id: `call_` and 24 hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of a call carries its `id` and
    `name` (and no arguments), later pieces carry argument text only."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        """The `choices[].delta.tool_calls[]` entry of a chat chunk."""
        if self.id is not None:
            fn = {"name": self.name, "arguments": self.arguments}
            return {"index": self.index, "id": self.id, "type": "function", "function": fn}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class ParserDelta:
    """What one `feed` (or `finish`) releases: content text and tool-call pieces."""

    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it

    def to_openai(self) -> dict[str, Any]:
        fn = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": fn}


@dataclass
class ExtractedToolCalls:
    """A whole message: `content` is None when there are tool calls and no other
    text (as OpenAI answers)."""

    content: str | None
    tool_calls: list[ToolCall]


def collect(deltas: list[ParserDelta]) -> ExtractedToolCalls:
    """The message the deltas add up to: what a client reassembling a stream gets."""
    content = "".join(d.content for d in deltas)
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        for piece in d.tool_calls:
            call = calls.get(piece.index)
            if call is None:
                call = calls[piece.index] = ToolCall(piece.id or "", piece.name or "", "")
            call.arguments += piece.arguments
    tool_calls = [calls[i] for i in sorted(calls)]
    return ExtractedToolCalls(None if tool_calls and not content else content, tool_calls)


class ToolParser(ABC):
    """Turns one choice's text into content and tool calls. Subclasses register
    under `name` (the `--tool-call-parser` value) with `register`."""

    name: ClassVar[str]

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        self.parallel_tool_calls = parallel_tool_calls

    @abstractmethod
    def feed(self, text: str) -> ParserDelta:
        """The next text delta; returns what can be released now. Never raises on
        what a model writes: text that is not a well-formed call stays content."""

    @abstractmethod
    def finish(self, text: str = "") -> ParserDelta:
        """The last text delta (if any), and the output has ended: releases
        whatever was held back."""

    def extract(self, text: str) -> ExtractedToolCalls:
        """The whole output at once (for a non-streamed reply)."""
        return collect([self.finish(text)])
