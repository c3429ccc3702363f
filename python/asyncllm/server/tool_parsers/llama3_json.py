"""Llama 3.x's JSON tool calls (vLLM's `llama3_json`): an output that begins
(after an optional `<|python_tag|>`) with a JSON object is a call

    {"name": "get_weather", "parameters": {"city": "Paris"}}

(`arguments` is read as well as `parameters`), several calls separated by `;`.
An output that begins with anything else is content, and so is a whole output
whose objects are not calls (a model's JSON answer is never an error).

Streaming: where the output opens an object, nothing is released until its
`"name"` and the start of its arguments have arrived; then the arguments are
sent as the model writes them, up to where a JSON scan says the arguments object
ends (no guessing at a closing brace). A call whose name was streamed and whose
JSON then breaks keeps the pieces sent, as with hermes."""

from __future__ import annotations

import json
import re

from asyncllm.server.tool_parsers.base import (
    MAX_CALL_CHARS,
    MAX_TOOL_CALLS,
    ParserDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)

TAG = "<|python_tag|>"
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:parameters|arguments)"\s*:\s*(?=\{)'
)
_WS = " \t\n\r"


class JsonScan:
    """Incremental JSON nesting of the object being read: each character once."""

    def __init__(self) -> None:
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def run(self, text: str, stop_depth: int) -> int:
        """Scan on; the index just past where the depth falls to `stop_depth`,
        or -1 when the text ends first."""
        i = self.pos
        while i < len(text):
            ch = text[i]
            i += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == stop_depth:
                    self.pos = i
                    return i
        self.pos = i
        return -1


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._text = ""  # the whole output so far
        self._mode = ""  # "" undecided, "calls", "content"
        self._start = 0  # where the object being read begins
        self._scan = JsonScan()
        self._index = -1  # the streamed call of the open object (-1: none)
        self._args = (0, 0)  # the open call's arguments: start, end sent to
        self._args_scan: JsonScan | None = None  # where they end, scanned as they come
        self._num_calls = 0
        self._broken = False  # the objects stopped being calls: the rest is content
        self._in_object = False  # an object began at `_start`

    def feed(self, text: str) -> ParserDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ParserDelta:
        self._text += text
        out = self._advance(final=True)
        if self._mode == "calls" and self._num_calls == 0:
            out.content = self._text  # no call after all: the output as written
        elif self._mode == "calls" and self._in_object and self._index < 0:
            out.content += self._text[self._start :]  # an object cut short: content
        return out

    def _advance(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        if not self._mode:
            head = self._text.lstrip(_WS)
            head = head[len(TAG) :].lstrip(_WS) if head.startswith(TAG) else head
            if not head or (not final and TAG.startswith(head)):
                return out
            self._mode = "calls" if head.startswith("{") else "content"
            self._start = len(self._text) - len(head) if self._mode == "calls" else 0
        while self._mode == "calls" and not self._broken and self._read_object(out):
            pass
        if self._mode == "content":
            out.content += self._text[self._start :]
            self._start = len(self._text)
        return out

    def _not_calls(self, at: int) -> None:
        """What follows `at` is not a call: content after calls, or (before any)
        the whole output is, released at the end."""
        if self._num_calls:
            self._mode, self._start = "content", at
        else:
            self._broken = True

    def _read_object(self, out: ParserDelta) -> bool:
        """Read on in the object at `_start`; True when it closed and another may follow."""
        text = self._text
        if not self._in_object:
            i = self._start
            while i < len(text) and text[i] in _WS + ";":
                i += 1
            if i >= len(text):
                return False
            if text[i] != "{" or self._num_calls >= MAX_TOOL_CALLS:
                self._not_calls(i)
                return False
            self._start = self._scan.pos = i
            self._in_object = True
        if self._index < 0:
            self._try_header(out)
        self._stream_args(out)
        end = self._scan.run(text, 0)
        if end < 0:
            return False
        if self._index < 0 and not self._close(out, text[self._start : end]):
            self._not_calls(self._start)
            return False
        self._start, self._scan, self._index, self._in_object = end, JsonScan(), -1, False
        return True

    def _try_header(self, out: ParserDelta) -> None:
        body = self._text[self._start : self._start + 1024]
        match = _HEADER.match(body)
        if match is None or not self._may_call():
            return
        try:
            name = json.loads(match.group(1))
        except ValueError:
            return
        if not isinstance(name, str) or not name:
            return
        self._index = self._num_calls
        self._num_calls += 1
        out.tool_calls.append(ToolCallDelta(self._index, new_call_id(), name, ""))
        start = self._start + match.end()
        self._args = (start, start)
        self._args_scan = JsonScan()
        self._args_scan.pos = start

    def _stream_args(self, out: ParserDelta) -> None:
        """Send the open call's arguments up to what has arrived of them (their
        own scan says where the object ends: nothing after it is sent)."""
        if self._index < 0 or self._args_scan is None:
            return
        start, sent = self._args
        end = self._args_scan.run(self._text, 0)
        upto = min(end if end >= 0 else len(self._text), start + MAX_CALL_CHARS)
        if end < 0:
            self._args_scan.pos = len(self._text)
        if upto > sent:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=self._text[sent:upto]))
            self._args = (start, upto)
        if end >= 0:
            self._args_scan = None  # the arguments are whole

    def _may_call(self) -> bool:
        if not self.parallel_tool_calls and self._num_calls >= 1:
            return False
        return self._num_calls < MAX_TOOL_CALLS

    def _close(self, out: ParserDelta, body: str) -> bool:
        """An object not streamed has closed: a call (True), or not one."""
        call = _parse(body)
        if call is None:
            return False
        if self._may_call():
            index = self._num_calls
            self._num_calls += 1
            out.tool_calls.append(ToolCallDelta(index, new_call_id(), call[0], ""))
            out.tool_calls.append(ToolCallDelta(index, arguments=call[1]))
        return True


def _parse(body: str) -> tuple[str, str] | None:
    if len(body) > MAX_CALL_CHARS:
        return None
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    args = obj.get("parameters", obj.get("arguments"))
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, json.dumps(args, ensure_ascii=False)
