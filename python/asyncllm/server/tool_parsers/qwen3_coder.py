"""Qwen3-Coder's XML-style tool calls (vLLM's `qwen3_coder`): each call is a block

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

and several blocks are parallel calls. A parameter's value is its text (one
newline either side dropped), sent as a JSON string, or as the JSON value it
spells when it is a number, true, false, null, an object or a list (the parser
sees no tool schemas). Text outside the blocks is content; whitespace after a
call is dropped. A block that does not open with `<function=NAME>` stays content,
markup included.

Streaming: content is released as it comes, except a tail that could begin
`<tool_call>`; a call's id and name are sent once `<function=NAME>` is whole, then
each parameter as `{"key": value` / `, "key": value` once its `</parameter>` has
arrived, and `}` at `</function>`. A call the output ends inside (max_tokens)
keeps the pieces sent.
"""

from __future__ import annotations

import json
import re

from asyncllm.server.tool_parsers.base import (
    MAX_TOOL_CALLS,
    ParserDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)
from asyncllm.server.tool_parsers.hermes import partial_suffix

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION_END, PARAMETER_END = "</function>", "</parameter>"
_FUNCTION = re.compile(r"\s*<function=([^<>\n]{1,256})>")
_PARAMETER = re.compile(r"\s*<parameter=([^<>\n]{1,256})>")
# a tag being written: what may still become `<function=...>` or `<parameter=...>`
_PARTIAL = re.compile(r"\s*(<(f(u(n(c(t(i(o(n(=[^<>\n]{0,256})?)?)?)?)?)?)?)?)?)?\Z")
_PARTIAL_PARAM = re.compile(r"\s*(<(p(a(r(a(m(e(t(e(r(=[^<>\n]{0,256})?)?)?)?)?)?)?)?)?)?)?\Z")
_WS = " \t\n\r"


def _value(text: str) -> str:
    """A parameter's text as JSON."""
    text = text.removeprefix("\n").removesuffix("\n")
    stripped = text.strip()
    if stripped[:1] in "-0123456789[{tfn" and stripped:
        try:
            value = json.loads(stripped)
        except ValueError:
            pass
        else:
            if not isinstance(value, str):
                return json.dumps(value, ensure_ascii=False)
    return json.dumps(text, ensure_ascii=False)


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""  # received, not yet released or consumed
        self._state = "content"  # content, function, params, value, end
        self._literal = ""  # the open block's text, while it may still be content
        self._index = -1  # the open call's index (-1: not sent)
        self._key = ""  # the open parameter
        self._num_params = 0
        self._num_calls = 0
        self._after_call = False

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ParserDelta:
        self._buf += text
        return self._advance(final=True)

    def _advance(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        step = {
            "content": self._read_content,
            "function": self._read_function,
            "params": self._read_params,
            "value": self._read_value,
            "end": self._read_end,
        }
        while step[self._state](out, final):
            pass
        return out

    def _content(self, out: ParserDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip(_WS)
            if not text:
                return
            self._after_call = False
        out.content += text

    def _read_content(self, out: ParserDelta, final: bool) -> bool:
        buf = self._buf
        i = buf.find(OPEN)
        if i < 0 or self._num_calls >= MAX_TOOL_CALLS:
            keep = 0 if final or i >= 0 else partial_suffix(buf, OPEN)
            self._content(out, buf[: len(buf) - keep])
            self._buf = buf[len(buf) - keep :]
            return False
        self._content(out, buf[:i])
        self._buf, self._literal = buf[i + len(OPEN) :], OPEN
        self._state = "function"
        return True

    def _read_function(self, out: ParserDelta, final: bool) -> bool:
        match = _FUNCTION.match(self._buf)
        if match is None:
            if not final and _PARTIAL.match(self._buf):
                return False
            self._content(out, self._literal)  # not a call: the markup is content
            self._state = "content"
            return True
        self._buf = self._buf[match.end() :]
        self._num_calls += 1
        self._index, self._num_params = -1, 0
        if self.parallel_tool_calls or self._num_calls == 1:
            self._index = self._num_calls - 1
            out.tool_calls.append(ToolCallDelta(self._index, new_call_id(), match.group(1), ""))
        self._state = "params"
        return True

    def _read_params(self, out: ParserDelta, final: bool) -> bool:
        buf = self._buf.lstrip(_WS)
        if buf.startswith(FUNCTION_END):
            self._send("{}" if self._num_params == 0 else "}", out)
            self._buf, self._state = buf[len(FUNCTION_END) :], "end"
            return True
        match = _PARAMETER.match(buf)
        if match is not None:
            self._key = match.group(1)
            self._buf, self._state = buf[match.end() :], "value"
            return True
        could_be = FUNCTION_END.startswith(buf) or _PARTIAL_PARAM.match(buf)
        if final or not could_be:  # cut, or broken: the call keeps what was sent
            self._buf, self._state = buf, "end"
        return not final and not could_be

    def _read_value(self, out: ParserDelta, final: bool) -> bool:
        i = self._buf.find(PARAMETER_END)
        if i < 0:
            return False  # cut by the end of the output: the pieces sent stay
        head = "{" if self._num_params == 0 else ", "
        key = json.dumps(self._key, ensure_ascii=False)
        self._send(f"{head}{key}: {_value(self._buf[:i])}", out)
        self._num_params += 1
        self._buf, self._state = self._buf[i + len(PARAMETER_END) :], "params"
        return True

    def _read_end(self, out: ParserDelta, final: bool) -> bool:
        """After `</function>` (or a broken call): up to the block's `</tool_call>`."""
        i = self._buf.find(CLOSE)
        if i < 0:
            if final:
                self._buf = ""
            return False
        self._buf, self._state = self._buf[i + len(CLOSE) :], "content"
        self._after_call = True
        return True

    def _send(self, text: str, out: ParserDelta) -> None:
        if self._index >= 0:
            out.tool_calls.append(ToolCallDelta(self._index, arguments=text))
