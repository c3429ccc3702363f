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
        # Where the element being read ends is found in one pass over the text
        # (each character looked at once, however the deltas are cut).
        self._scanned = 0
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        out = ParserDelta()
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

    def _element_end(self) -> int:
        """The end of the object that starts at `_pos`, or -1 while it is open."""
        buf = self._buf
        i = max(self._scanned, self._pos)
        while i < len(buf):
            ch = buf[i]
            i += 1
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._scanned = i
                    return i
        self._scanned = i
        return -1

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
            if self._depth == 0:
                self._skip(_WS + ",")
                if self._pos >= len(self._buf) or self._buf[self._pos] == "]":
                    return
                if self._buf[self._pos] != "{":
                    self._broken = True
                    return
            end = self._element_end()
            if end < 0:
                return  # not complete yet (or never: then finish() makes it content)
            try:
                obj = json.loads(self._buf[self._pos : end])
            except ValueError:
                obj = None
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
