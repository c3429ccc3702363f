"""What a reasoning parser does: split one choice's text into its reasoning (the
`<think>…</think>` part a reasoning model writes first) and its answer, streamed
as deltas or whole.

A parser is made per choice, fed that choice's text deltas in order (`feed`),
then `finish` once; fed the whole text at once it gives the same split, so a
streamed reply adds up to the non-streamed one however the text is cut (a tag
split across tokens included: a tail that could begin a tag is held back).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from asyncllm.structured_output.params import ReasoningTags


@dataclass
class ReasoningDelta:
    """What one `feed` (or `finish`) releases: reasoning text and answer text."""

    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (not all of it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningParser(ABC):
    """Splits one choice's text into reasoning and answer. Subclasses register
    under `name` (the `--reasoning-parser` value)."""

    name: ClassVar[str]
    # where the reasoning is, for a constraint that applies to the answer only
    tags: ClassVar[ReasoningTags]

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta:
        """The next text delta; returns what can be released now."""

    @abstractmethod
    def finish(self, text: str = "") -> ReasoningDelta:
        """The last text delta (if any), and the output has ended: releases
        whatever was held back."""

    def extract(self, text: str) -> tuple[str | None, str]:
        """(reasoning or None when there was none, answer) of a whole text."""
        out = self.finish(text)
        return (out.reasoning or None), out.content
