"""Mistral's tool calls (vLLM's `mistral`): text up to `[TOOL_CALLS]` is content;
after it come the calls, in either of the two forms Mistral's tokenizers write:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}

(the JSON list of the v3 tokenizers, or name and `[ARGS]` of v11 and later).
What follows the tag and is not a call ends the calls: with no call read, the
whole output is content as written (a model's text is never an error).

Streaming: content is released as it comes, except a tail that could begin
`[TOOL_CALLS]`; a call's id and name are sent once its name is whole (the JSON
form: `{"name": "...", "arguments": ` has arrived), then its arguments as the
model writes them, up to where a JSON scan says their object ends. A call the
output ends inside (max_tokens) keeps the pieces sent, as with the other parsers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from asyncllm.server.tool_parsers.base import (
    MAX_TOOL_CALLS,
    ParserDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from asyncllm.server.tool_parsers.hermes import partial_suffix
from asyncllm.server.tool_parsers.llama3_json import JsonScan

TAG = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,256}")
_MAX_NAME = 256
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_MAX_HEADER = 1024
_BETWEEN = " \t\n\r,[]"  # what may separate the calls of the JSON form


@dataclass
class _Call:
    """The call being read: its index (-1: not sent, parallel calls off), where its
    arguments start and have been sent to, and whether an object wraps it."""

    index: int
    sent: int
    scan: JsonScan
    wrapped: bool
    args_done: bool = False


class MistralToolParser(ToolParser):
    name = "mistral"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._text = ""
        self._pos = 0  # the text before this was released or consumed
        self._in_calls = False
        self._call: _Call | None = None
        self._num_calls = 0  # calls read (sent or not)
        self._num_sent = 0
        self._tag_at = 0  # where the calls began
        self._rest_is_content = False  # something not a call ended them

    def feed(self, text: str) -> ParserDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ParserDelta:
        self._text += text
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        if self._rest_is_content:
            out.content += self._text[self._pos :]
            self._pos = len(self._text)
            return out
        if not self._in_calls:
            text = self._text
            i = text.find(TAG, self._pos)
            if i < 0:
                keep = 0 if final else partial_suffix(text, TAG)
                out.content += text[self._pos : len(text) - keep]
                self._pos = len(text) - keep
                return out
            out.content += text[self._pos : i]
            self._in_calls, self._pos = True, i + len(TAG)
            self._tag_at = i
        while self._read_call(out, final):
            pass
        return out

    def _read_call(self, out: ParserDelta, final: bool) -> bool:
        """Read on; True when a call ended and another may follow."""
        text = self._text
        if self._call is None:
            pos = self._skip(text, self._pos)
            if pos == len(text) or (not final and TAG.startswith(text[pos:])):
                return False
            self._pos = pos
            started = self._start_call(out, final)
            if started is None:  # not a call: the rest is content
                self._to_content(out)
                return False
            if not started:
                return False
        call = self._call
        assert call is not None
        if not call.args_done:
            end = call.scan.run(text, 0)
            upto = len(text) if end < 0 else end
            if call.index >= 0 and upto > call.sent:
                out.tool_calls.append(ToolCallDelta(call.index, arguments=text[call.sent : upto]))
            call.sent = upto
            if end < 0:
                return False
            call.args_done = True
        pos = call.sent
        if call.wrapped:  # the JSON form: the call's own object closes after its arguments
            while pos < len(text) and text[pos] in " \t\n\r":
                pos += 1
            if pos == len(text):
                return False
            if text[pos] != "}":
                self._call, self._pos = None, pos
                self._to_content(out)
                return False
            pos += 1
        self._call, self._pos = None, pos
        return True

    def _skip(self, text: str, pos: int) -> int:
        """Past separators and repeated tags between calls (stopping at what may
        be the start of a tag)."""
        while pos < len(text):
            if text.startswith(TAG, pos):
                pos += len(TAG)
            elif text[pos] not in _BETWEEN or TAG.startswith(text[pos:]):
                return pos
            else:
                pos += 1
        return pos

    def _start_call(self, out: ParserDelta, final: bool) -> bool | None:
        """Open the call at `_pos`: True once its name is known, False while it
        may still become one, None when it is not a call."""
        text, pos = self._text, self._pos
        if self._num_calls >= MAX_TOOL_CALLS:
            return None
        if text[pos] == "{":
            match = _HEADER.match(text, pos, pos + _MAX_HEADER)
            if match is None:
                return None if final or len(text) - pos >= _MAX_HEADER else False
            try:
                name = json.loads(match.group(1))
            except ValueError:
                return None
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                return None
            self._open(out, name, match.end(), wrapped=True)
            return True
        j = text.find(ARGS, pos, pos + _MAX_NAME + len(ARGS))
        if j < 0:
            tail = text[pos:]
            name = tail[: len(tail) - partial_suffix(tail, ARGS)]
            could_be = not name or _NAME.fullmatch(name)
            return None if final or not could_be else False
        name = text[pos:j]
        start = j + len(ARGS)
        if not _NAME.fullmatch(name):
            return None
        if start == len(text) and not final:
            return False
        if not text.startswith("{", start):
            return None
        self._open(out, name, start, wrapped=False)
        return True

    def _open(self, out: ParserDelta, name: str, args_start: int, wrapped: bool) -> None:
        index = -1
        if self.parallel_tool_calls or self._num_sent == 0:
            index = self._num_sent
            self._num_sent += 1
            out.tool_calls.append(ToolCallDelta(index, new_call_id(), name, ""))
        self._num_calls += 1
        scan = JsonScan()
        scan.pos = args_start
        self._call = _Call(index, args_start, scan, wrapped)

    def _to_content(self, out: ParserDelta) -> None:
        """The rest of the output is content: from the tag when no call was read."""
        start = self._tag_at if self._num_calls == 0 else self._pos
        out.content += self._text[start:]
        self._pos = len(self._text)
        self._rest_is_content = True
