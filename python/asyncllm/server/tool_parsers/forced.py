"""Parsers for output that `tool_choice` constrained (as vLLM does it):

- a named function: the output is the function's arguments object itself, so the
  whole text is that call's `arguments` (streamed as it comes);
- "required": the output is a JSON array of `{"name": ..., "parameters": {...}}`,
  one per call; each call is released once its object is complete.

They are not registered: the server picks them from `tool_choice`, not from
`--tool-call-parser`.
"""

from __future__ import annotations

import json

from asyncllm.server.tool_parsers.base import (
    MAX_TOOL_CALLS,
    ParserDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)

_DECODER = json.JSONDecoder()
_WS = " \t\n\r"


class NamedToolParser(ToolParser):
    """The output is the arguments of the one function `tool_choice` names."""

    name = "named"

    def __init__(self, function_name: str, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self.function_name = function_name
        self._started = False

    def feed(self, text: str) -> ParserDelta:
        out = ParserDelta()
        if not self._started:
            self._started = True
            out.tool_calls.append(ToolCallDelta(0, new_call_id(), self.function_name, ""))
        if text:
            out.tool_calls.append(ToolCallDelta(0, arguments=text))
        return out

    def finish(self, text: str = "") -> ParserDelta:
        return self.feed(text)


class RequiredToolParser(ToolParser):
    """The output is `[{"name": ..., "parameters": {...}}, ...]`. Output that is not
    such an array (cut by max_tokens, or not constrained) is content, released at
    the end."""

    name = "required"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""
        self._pos = 0  # where the next array element (or `]`) may begin
        self._opened = False  # the array's `[` was read
        self._num_calls = 0
        self._broken = False  # the text is not such an array

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        out = ParserDelta()
        if "}" in text or "[" in text:
            self._scan(out)
        return out

    def finish(self, text: str = "") -> ParserDelta:
        self._buf += text
        out = ParserDelta()
        self._scan(out)
        if self._num_calls == 0:
            out.content = self._buf
        return out

    def _skip(self, chars: str) -> None:
        while self._pos < len(self._buf) and self._buf[self._pos] in chars:
            self._pos += 1

    def _scan(self, out: ParserDelta) -> None:
        if self._broken:
            return
        if not self._opened:
            self._skip(_WS)
            if self._pos >= len(self._buf):
                return
            if self._buf[self._pos] != "[":
                self._broken = True
                return
            self._pos += 1
            self._opened = True
        while self._num_calls < MAX_TOOL_CALLS:
            self._skip(_WS + ",")
            if self._pos >= len(self._buf) or self._buf[self._pos] == "]":
                return
            try:
                obj, end = _DECODER.raw_decode(self._buf, self._pos)
            except ValueError:
                return  # not complete yet (or never: then finish() makes it content)
            name = obj.get("name") if isinstance(obj, dict) else None
            params = obj.get("parameters") if isinstance(obj, dict) else None
            if not isinstance(name, str) or not name or not isinstance(params, dict):
                self._broken = True
                return
            self._pos = end
            index = self._num_calls
            self._num_calls += 1
            args = json.dumps(params, ensure_ascii=False)
            out.tool_calls.append(ToolCallDelta(index, new_call_id(), name, ""))
            out.tool_calls.append(ToolCallDelta(index, arguments=args))
