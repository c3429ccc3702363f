"""`<think>…</think>` reasoning, with vLLM's parser names:

- `deepseek_r1`: the output starts in reasoning (DeepSeek-R1's template opens
  `<think>` in the prompt; a leading `<think>` the model writes itself is
  dropped) and `</think>` ends it. An output that never closes it is all
  reasoning (cut by max_tokens while thinking).
- `qwen3`: the output is reasoning only if it begins with `<think>` (Qwen3
  writes it itself; with `enable_thinking: false` its template closes an empty
  block in the prompt and the output is all answer).

Whitespace between `</think>` and the answer is dropped, as vLLM's parsers do.
"""

from __future__ import annotations

from asyncllm.server.reasoning.base import ReasoningDelta, ReasoningParser, partial_suffix
from asyncllm.structured_output.params import ReasoningTags

OPEN = "<think>"
CLOSE = "</think>"
_WS = " \t\n\r"


class ThinkParser(ReasoningParser):
    """The shared machine; subclasses say whether the output starts thinking."""

    name = "think"
    starts_in_reasoning = True

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # "start" (before the first text), "reasoning", "answer"
        self._strip = False  # drop the whitespace that begins the answer

    def feed(self, text: str) -> ReasoningDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self, text: str = "") -> ReasoningDelta:
        self._buf += text
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningDelta:
        out = ReasoningDelta()
        if self._state == "start":
            head = self._buf.lstrip(_WS)
            if not final and len(head) < len(OPEN) and OPEN.startswith(head):
                return out  # could still become `<think>`
            if head.startswith(OPEN):
                self._buf = head[len(OPEN) :]
                self._state = "reasoning"
            else:
                self._state = "reasoning" if self.starts_in_reasoning else "answer"
        if self._state == "reasoning":
            i = self._buf.find(CLOSE)
            if i < 0:
                keep = 0 if final else partial_suffix(self._buf, CLOSE)
                out.reasoning = self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out
            out.reasoning = self._buf[:i]
            self._buf = self._buf[i + len(CLOSE) :]
            self._state = "answer"
            self._strip = True
        if self._strip:
            self._buf = self._buf.lstrip(_WS)
            if not self._buf:
                return out
            self._strip = False
        out.content, self._buf = self._buf, ""
        return out


class DeepSeekR1ReasoningParser(ThinkParser):
    name = "deepseek_r1"
    starts_in_reasoning = True
    tags = ReasoningTags(close=CLOSE)


class Qwen3ReasoningParser(ThinkParser):
    name = "qwen3"
    starts_in_reasoning = False
    tags = ReasoningTags(close=CLOSE, open=OPEN)
