"""What a constrained request's output must match: one JSON schema, regex, choice
list or grammar (vLLM's `StructuredOutputsParams`, same names), applied to the
whole output or, for a reasoning model, to the answer after its reasoning.

A leaf module: the server and `SamplingParams` build it, the engine compiles it.
Only shape and size are checked here (every size a client controls is bounded);
whether a schema, regex or grammar compiles is for the grammar compiler to say.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from asyncllm.errors import ConfigError

# Bounds on what one request may send (the compiler has its own limits on top).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 4096

KINDS = ("json", "regex", "choice", "grammar", "json_object")
# The kind of a constraint that applies after the reasoning (see ReasoningTags).
AFTER_REASONING = "after_reasoning"
MAX_TAG_CHARS = 64


def _fail(name: str, value: object, allowed: str) -> ConfigError:
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ConfigError(f"StructuredOutputsParams.{name}={shown} is invalid: must be {allowed}")


@dataclass(frozen=True)
class ReasoningTags:
    """Where a reasoning model's reasoning is, so that a constraint applies to
    the answer after it and leaves the reasoning free (as vLLM does with a
    reasoning parser). `open` None: the output starts inside the block (its
    template opened it); else the block is optional and begins the output."""

    close: str
    open: str | None = None

    def __post_init__(self) -> None:
        _check_tag("close", self.close)
        if self.open is not None:
            _check_tag("open", self.open)


def _check_tag(name: str, tag: object) -> None:
    """A tag the grammar can spell as a literal without escaping."""
    if (
        not isinstance(tag, str)
        or not tag
        or len(tag) > MAX_TAG_CHARS
        or not all(c.isascii() and c.isprintable() and c not in ' "\\' for c in tag)
    ):
        raise _fail(
            f"after_reasoning.{name}",
            tag,
            f"printable ASCII without spaces, quotes or backslashes, at most {MAX_TAG_CHARS} chars",
        )


@dataclass
class StructuredOutputsParams:
    """Exactly one of the fields is set. `json` is a JSON schema (a dict or its
    JSON text); `json_object=True` asks for any JSON object; `grammar` is a Lark
    grammar (llguidance's dialect). `after_reasoning` (not vLLM's: the server
    sets it from its reasoning parser) applies the constraint to the answer
    only."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    after_reasoning: ReasoningTags | None = None

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ConfigError(
                "StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}"
            )
        if self.json is not None:
            if isinstance(self.json, dict):
                try:
                    text = json.dumps(self.json)
                except (TypeError, ValueError) as e:
                    raise _fail("json", self.json, f"JSON-serialisable ({e})") from None
            elif isinstance(self.json, str):
                text = self.json
                try:
                    parsed = json.loads(text)
                except ValueError as e:
                    raise _fail("json", self.json, f"a JSON schema ({e})") from None
                if not isinstance(parsed, dict | bool):
                    raise _fail("json", self.json, "a JSON schema (an object)")
            else:
                raise _fail("json", self.json, "a JSON schema (dict or str)")
            if len(text) > MAX_SPEC_CHARS:
                raise _fail("json", f"<{len(text)} chars>", f"at most {MAX_SPEC_CHARS} chars")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, str) or not value:
                raise _fail(name, value, "a non-empty string")
            if len(value) > MAX_SPEC_CHARS:
                raise _fail(name, f"<{len(value)} chars>", f"at most {MAX_SPEC_CHARS} chars")
        if self.choice is not None:
            if not isinstance(self.choice, list | tuple) or not self.choice:
                raise _fail("choice", self.choice, "a non-empty list of strings")
            if len(self.choice) > MAX_CHOICES:
                raise _fail("choice", f"<{len(self.choice)} items>", f"at most {MAX_CHOICES}")
            for c in self.choice:
                if not isinstance(c, str) or not c or len(c) > MAX_CHOICE_CHARS:
                    raise _fail(
                        "choice", c, f"a list of non-empty strings of <= {MAX_CHOICE_CHARS} chars"
                    )
            total = sum(len(c) for c in self.choice)
            if total > MAX_SPEC_CHARS:
                raise _fail(
                    "choice", f"<{total} chars in all>", f"at most {MAX_SPEC_CHARS} chars in all"
                )
            self.choice = list(self.choice)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _fail("json_object", self.json_object, "a bool")

    @classmethod
    def from_spec(cls, kind: str, spec: str) -> StructuredOutputsParams:
        """The inverse of (`kind`, `spec()`): how the engine core rebuilds it from
        the wire. Raises ConfigError as the constructor does."""
        if kind == AFTER_REASONING:
            try:
                body = json.loads(spec)
                tags = ReasoningTags(close=body["close"], open=body["open"])
                answer = cls.from_spec(body["kind"], body["spec"])
            except (ValueError, KeyError, TypeError) as e:
                raise _fail(AFTER_REASONING, spec, f"an answer after reasoning ({e})") from None
            if answer.after_reasoning is not None:
                raise _fail(AFTER_REASONING, spec, "one level of reasoning")
            return replace(answer, after_reasoning=tags)
        if kind == "json":
            return cls(json=spec)
        if kind == "choice":
            try:
                choices = json.loads(spec)
            except ValueError as e:
                raise _fail("choice", spec, f"a JSON list of strings ({e})") from None
            return cls(choice=choices)
        if kind == "json_object":
            return cls(json_object=True)
        if kind == "regex":
            return cls(regex=spec)
        if kind == "grammar":
            return cls(grammar=spec)
        raise ConfigError(f"StructuredOutputsParams: unknown kind {kind!r}; one of {KINDS}")

    @property
    def answer_kind(self) -> str:
        """Which constraint the output (or the answer) matches: one of KINDS."""
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def kind(self) -> str:
        """The kind the compiler gets: `answer_kind`, or AFTER_REASONING."""
        return self.answer_kind if self.after_reasoning is None else AFTER_REASONING

    def spec(self) -> str:
        """The constraint as text for the compiler: the schema as JSON text, the
        regex or grammar as given, the choices as a JSON list, "" for json_object;
        after reasoning, the tags with the answer's kind and spec as JSON."""
        tags = self.after_reasoning
        if tags is not None:
            answer = {"kind": self.answer_kind, "spec": self.answer_spec()}
            return json.dumps({"open": tags.open, "close": tags.close, **answer})
        return self.answer_spec()

    def answer_spec(self) -> str:
        """`spec()` of the constraint alone, without the reasoning."""
        kind = self.answer_kind
        if kind == "json":
            return self.json if isinstance(self.json, str) else json.dumps(self.json)
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        value = getattr(self, kind)
        assert isinstance(value, str)
        return value
