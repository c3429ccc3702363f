"""Python-call tool calls (vLLM's `pythonic`, as Llama 3.2 / 4 and others write
them): an output that begins (after an optional `<|python_start|>`) with a list
of calls with keyword arguments

    [get_weather(city="Paris", unit="celsius"), get_time(zone=1)]

holds those calls; each argument is a Python literal (strings, numbers,
True/False/None, lists, dicts), sent as JSON. An output that begins otherwise is
content, and so is a whole output whose list holds no such call; text after the
list's `]` is content, and a list that breaks after a call ends the reading.

Streaming: a call's id and name are sent once its `name(` and its first `key=`
(or its `)`) have arrived, then each
argument as soon as its value is complete (`{"city": "Paris"`, then `, "unit":
"celsius"`, then `}` when the call closes): pieces of JSON text that add up to
`json.dumps` of the arguments. A call whose name was streamed keeps its pieces if
the list then breaks (or max_tokens cuts it), as with the other parsers."""

from __future__ import annotations

import ast
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

TAGS = ("<|python_start|>", "<|python_tag|>")
END_TAG = "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_KEY = re.compile(r"\s*([A-Za-z_]\w*)\s*=")
_WS = " \t\n\r"


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._text = ""
        self._mode = ""  # "" undecided, "calls", "content", "done", "broken"
        self._pos = 0  # where reading goes on
        self._index = -1  # the call being read (-1: between calls)
        self._num_calls = 0
        self._num_args = 0
        self._call_start = 0
        # the value being read: its start, and the scan's position, depth, quote
        self._value = (-1, 0, 0, "")
        self._key = ""  # the argument being read
        self._name = ""  # the call's name, until it is sent

    def feed(self, text: str) -> ParserDelta:
        self._text += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ParserDelta:
        self._text += text
        out = self._advance(final=True)
        if self._num_calls == 0 and self._mode != "content":
            out = ParserDelta(self._text)  # held back, and no call: the output as written
        elif self._mode == "done":
            rest = self._text[self._pos :].strip()
            out.content += rest.removeprefix(END_TAG).strip()
        return out

    def _advance(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        if not self._mode:
            head = self._text.lstrip(_WS)
            for tag in TAGS:
                if head.startswith(tag):
                    head = head[len(tag) :].lstrip(_WS)
            if not head or (not final and any(t.startswith(head) for t in TAGS)):
                return out
            self._mode = "calls" if head.startswith("[") else "content"
            self._pos = len(self._text) - len(head) + 1 if self._mode == "calls" else 0
        if self._mode == "content":
            out.content, self._pos = self._text[self._pos :], len(self._text)
            return out
        while self._mode == "calls" and self._step(out):
            pass
        return out

    def _step(self, out: ParserDelta) -> bool:
        """One move of the reader; False when it must wait for more text."""
        text = self._text
        if self._index < 0:  # between calls: a name, `,` or `]`
            i = self._pos
            while i < len(text) and text[i] in _WS:
                i += 1
            if i >= len(text):
                return False
            if text[i] == "]":
                self._mode, self._pos = "done", i + 1
                return False
            if text[i] == "," and self._num_calls:
                self._pos = i + 1
                return True
            match = _NAME.match(text, i)
            if match is None:
                if re.fullmatch(r"[\w.\s]*", text[i:]):
                    return False  # a name still arriving
                return self._break()
            if self._num_calls >= MAX_TOOL_CALLS:
                return self._break()
            self._index, self._num_args, self._call_start = self._num_calls, 0, i
            self._pos = match.end()
            self._name = match.group(1)  # sent with the first argument's key, or `)`
            return True
        return self._read_argument(out)

    def _may_send(self) -> bool:
        return self.parallel_tool_calls or self._index == 0

    def _read_argument(self, out: ParserDelta) -> bool:
        text = self._text
        if self._pos - self._call_start > MAX_CALL_CHARS:
            return self._break()
        start, scan, depth, quote = self._value
        if start < 0:  # a key, or the call's `)`
            i = self._pos
            while i < len(text) and text[i] in _WS + ",":
                i += 1
            if i >= len(text):
                return False
            if text[i] == ")":
                self._send_name(out)
                self._send(out, "}" if self._num_args else "{}")
                self._index, self._pos = -1, i + 1
                return True
            match = _KEY.match(text, i)
            if match is None:
                return False if re.fullmatch(r"\w*\s*", text[i:]) else self._break()
            self._key = match.group(1)
            self._send_name(out)
            start = scan = match.end()
        end, scan, depth, quote = _value_end(text, scan, depth, quote)
        if end == -2:
            return self._break()
        if end < 0:
            self._value = (start, scan, depth, quote)
            return False
        self._value = (-1, 0, 0, "")
        try:
            value = ast.literal_eval(text[start:end].strip())
            piece = json.dumps({self._key: value}, ensure_ascii=False)[1:-1]
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            return self._break()
        self._send(out, ("{" if self._num_args == 0 else ", ") + piece)
        self._num_args += 1
        self._pos = end
        return True

    def _send_name(self, out: ParserDelta) -> None:
        """The call is one (its first key or its `)` came): count it, send its name."""
        if not self._name:
            return
        self._num_calls += 1
        if self._may_send():
            out.tool_calls.append(ToolCallDelta(self._index, new_call_id(), self._name, ""))
        self._name = ""

    def _send(self, out: ParserDelta, arguments: str) -> None:
        if self._may_send():
            out.tool_calls.append(ToolCallDelta(self._index, arguments=arguments))

    def _break(self) -> bool:
        self._mode = "broken"
        return False


def _value_end(text: str, i: int, depth: int, quote: str) -> tuple[int, int, int, str]:
    """Scan a Python literal from `i` (resuming at `depth`, inside `quote`):
    (the index of the `,` or `)` that ends it, -1 while open or -2 when it cannot
    be a value, where the scan stopped, the depth, the open quote)."""
    escaped = False
    while i < len(text):
        ch = text[i]
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                return (i, i, 0, "") if ch == ")" else (-2, i, depth, quote)
            depth -= 1
        elif ch == "," and depth == 0:
            return i, i, 0, ""
        i += 1
    if escaped:  # resume before the backslash, so the escape is seen whole
        i -= 1
    return -1, i, depth, quote
