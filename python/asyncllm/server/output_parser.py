"""One choice's output read in two stages: the reasoning parser (if the server
has one) takes the `<think>` part off the front, and the tool parser (if the
request has tools) reads calls out of the answer that follows. Every endpoint
(chat, Responses, Messages) streams from this one machine, so they split a
model's text the same way, and tool calls are looked for only after the
reasoning, never inside it."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.server.reasoning import ReasoningParser
from asyncllm.server.tool_parsers import ParserDelta, ToolCall, ToolCallDelta, ToolParser
from asyncllm.server.tool_parsers.base import collect


@dataclass
class OutputDelta:
    """What one `feed` (or `finish`) releases, in the order it was written:
    reasoning, then answer text and tool-call pieces."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class ParsedOutput:
    """A whole output: `content` is None when there are tool calls and no text."""

    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall]


class OutputParser:
    """Made per choice; `feed` each text delta in order, then `finish` once."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    def feed(self, text: str) -> OutputDelta:
        return self._step(text, final=False)

    def finish(self, text: str = "") -> OutputDelta:
        return self._step(text, final=True)

    def _step(self, text: str, final: bool) -> OutputDelta:
        out = OutputDelta()
        answer = text
        if self.reasoning is not None:
            r = self.reasoning.finish(text) if final else self.reasoning.feed(text)
            out.reasoning, answer = r.reasoning, r.content
        if self.tools is None:
            out.content = answer
            return out
        t = self.tools.finish(answer) if final else self.tools.feed(answer)
        out.content, out.tool_calls = t.content, t.tool_calls
        return out

    def extract(self, text: str) -> ParsedOutput:
        """The whole output at once (a non-streamed reply)."""
        delta = self.finish(text)
        if self.tools is None:
            return ParsedOutput(delta.reasoning or None, delta.content, [])
        found = collect([ParserDelta(delta.content, delta.tool_calls)])
        return ParsedOutput(delta.reasoning or None, found.content, found.tool_calls)
