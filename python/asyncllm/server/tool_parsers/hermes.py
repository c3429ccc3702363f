"""The Hermes / Qwen tool-call format: each call is a block

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

and several blocks are parallel calls. Text outside the blocks is content;
whitespace next to a block is dropped. A block that is not a JSON object with a
string `name` and an object `arguments` stays content, markup included (a model's
malformed output is never an error). A final block the output ends inside (no
closing tag: the model stopped on EOS) counts when its JSON is complete.

Streaming: content is released as it comes, except a tail that could begin
`<tool_call>`; inside a block, the call's id and name are sent once
`{"name": "...", "arguments": ` has arrived, then the arguments text as the
model writes it, holding back only what could be the block's closing `}` and tag.
The arguments of a call are the model's own JSON text (not re-serialised), so the
pieces add up to exactly what the non-streamed reply holds. One case cannot be
undone: a block whose name was streamed and whose JSON then breaks, or which the
output ends inside (max_tokens), keeps the pieces already sent; the non-streamed
reply makes it content.
"""

from __future__ import annotations

import json
import logging
import re

from asyncllm.server.tool_parsers.base import (
    MAX_CALL_CHARS,
    MAX_TOOL_CALLS,
    ParserDelta,
    ToolCallDelta,
    ToolParser,
    new_call_id,
)

logger = logging.getLogger(__name__)

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
# The start of a call in the order the format (and the qwen2.5 template) writes it,
# up to where its arguments object begins.
_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*(?=\{)')
_TAIL = re.compile(r"\s*\}\s*")
_WS = " \t\n\r"
# A block whose header has not matched within this many characters is resolved
# when it closes, not streamed (keeps each delta's work bounded).
_MAX_HEADER_CHARS = 1024
_DECODER = json.JSONDecoder()


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _strip_end(text: str, end: int, floor: int) -> int:
    """`end` moved back over whitespace, not below `floor` (no copy of `text`)."""
    while end > floor and text[end - 1] in _WS:
        end -= 1
    return end


def _in_json_string(body: str, end: int) -> bool:
    """Whether `body[:end]` ends inside a JSON string (from its first `{`): a
    closing tag there is text of the arguments, not the end of the block. Run
    only when a closing tag was found, so each block is scanned a few times."""
    start = body.find("{", 0, end)
    if start < 0:
        return False
    in_string = escaped = False
    for ch in body[start:end]:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = in_string
        elif ch == '"':
            in_string = not in_string
    return in_string


def _header_name(match: re.Match[str]) -> str | None:
    try:
        name = json.loads(match.group(1))
    except ValueError:
        return None
    return name if isinstance(name, str) and name else None


def parse_call(body: str) -> tuple[str, str] | None:
    """(name, arguments JSON text) of one block's body, or None when it is not a
    call. The arguments are the model's own text of the object where the block
    has the usual shape; otherwise (keys in another order) they are re-serialised."""
    if len(body) > MAX_CALL_CHARS:
        return None
    raw = None
    match = _HEADER.match(body)
    if match:
        try:
            obj, end = _DECODER.raw_decode(body, match.end())
        except ValueError:
            obj = None
        if isinstance(obj, dict):
            raw = body[match.end() : end]
            name = _header_name(match)
            if name is not None and _TAIL.fullmatch(body, end):
                return name, raw
    try:
        whole = json.loads(body)
    except ValueError:
        return None
    if not isinstance(whole, dict):
        return None
    name, args = whole.get("name"), whole.get("arguments")
    if not isinstance(name, str) or not name or not isinstance(args, dict):
        return None
    return name, raw if raw is not None else json.dumps(args, ensure_ascii=False)


class _Block:
    """The streaming state of the block being read."""

    def __init__(self) -> None:
        self.index = -1  # the call's index once its header was sent
        self.name = ""
        self.args_start = 0  # where the arguments begin in the body
        self.sent_to = 0  # the body up to here has been sent
        self.close_from = 0  # the closing tag is not before here


class HermesToolParser(ToolParser):
    name = "hermes"

    def __init__(self, parallel_tool_calls: bool = True) -> None:
        super().__init__(parallel_tool_calls)
        self._buf = ""  # text received and not yet released or consumed
        self._block: _Block | None = None  # inside a <tool_call> block
        self._num_calls = 0
        self._pending_ws = ""  # trailing whitespace of the content, held back
        self._after_call = False  # drop the whitespace that follows a call

    def feed(self, text: str) -> ParserDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ParserDelta:
        self._buf += text
        out = self._advance(final=True)
        if self._num_calls == 0 and self._pending_ws:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _advance(self, final: bool) -> ParserDelta:
        out = ParserDelta()
        while True:
            if self._block is None:
                i = self._buf.find(OPEN)
                if i < 0:
                    keep = 0 if final else partial_suffix(self._buf, OPEN)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(out, self._buf[:i])
                self._buf = self._buf[i + len(OPEN) :]
                self._block = _Block()
                continue
            j = self._buf.find(CLOSE, self._block.close_from)
            while j >= 0 and _in_json_string(self._buf, j):  # a tag the arguments quote
                j = self._buf.find(CLOSE, j + 1)
            if j >= 0:
                body, self._buf = self._buf[:j], self._buf[j + len(CLOSE) :]
                self._close(out, body, OPEN + body + CLOSE)
                continue
            if final:
                body, self._buf = self._buf, ""
                self._close(out, body, OPEN + body)
                return out
            self._block.close_from = max(0, len(self._buf) - len(CLOSE) + 1)
            self._stream(out, self._buf)
            return out

    def _may_call(self) -> bool:
        if not self.parallel_tool_calls and self._num_calls >= 1:
            return False
        return self._num_calls < MAX_TOOL_CALLS

    def _content(self, out: ParserDelta, text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            if not text:
                return
            self._after_call = False
        text = self._pending_ws + text
        kept = text.rstrip()
        self._pending_ws = text[len(kept) :]
        out.content += kept

    def _start_call(self, out: ParserDelta, block: _Block, name: str) -> None:
        block.index, block.name = self._num_calls, name
        self._num_calls += 1
        self._pending_ws = ""
        out.tool_calls.append(ToolCallDelta(block.index, new_call_id(), name, ""))

    def _stream(self, out: ParserDelta, body: str) -> None:
        """Release what is certain of the open block `body`."""
        block = self._block
        assert block is not None
        if block.index < 0:
            if len(body) > _MAX_HEADER_CHARS:
                return
            match = _HEADER.match(body)
            name = _header_name(match) if match else None
            if match is None or name is None or not self._may_call():
                return
            self._start_call(out, block, name)
            block.args_start = block.sent_to = match.end()
        end = _strip_end(body, len(body) - partial_suffix(body, CLOSE), block.sent_to)
        if end > block.args_start and body[end - 1] == "}":  # perhaps the block's own
            end = _strip_end(body, end - 1, block.sent_to)
        end = min(end, block.args_start + MAX_CALL_CHARS)
        if end > block.sent_to:
            out.tool_calls.append(ToolCallDelta(block.index, arguments=body[block.sent_to : end]))
            block.sent_to = end

    def _close(self, out: ParserDelta, body: str, literal: str) -> None:
        """The block ended (its closing tag, or the end of the output)."""
        block = self._block
        assert block is not None
        self._block = None
        call = parse_call(body)
        if block.index >= 0:  # already streamed: send the rest of its arguments
            sent = body[block.args_start : block.sent_to]
            if call is not None and call[0] == block.name and call[1].startswith(sent):
                rest = call[1][len(sent) :]
                if rest:
                    out.tool_calls.append(ToolCallDelta(block.index, arguments=rest))
            else:
                logger.debug("tool call %d broke after it was streamed", block.index)
            self._after_call = True
            return
        if call is None or self._num_calls >= MAX_TOOL_CALLS:
            self._content(out, literal)
            return
        self._after_call = True
        if not self._may_call():  # parallel_tool_calls is false: only the first call
            self._pending_ws = ""
            return
        self._start_call(out, block, call[0])
        if call[1]:
            out.tool_calls.append(ToolCallDelta(block.index, arguments=call[1]))
