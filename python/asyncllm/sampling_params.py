"""Sampling parameters of one request, validated once at construction.

Names and meanings follow vLLM's `SamplingParams` so its users feel at home.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.structured_output.params import StructuredOutputsParams

_MAX_LOGPROBS = 20
_UINT64_MAX = 2**64 - 1
# Below this temperature a request is greedy, as in vLLM: 1 / temperature would
# overflow float32 on the way to the distribution.
_SAMPLING_EPS = 1e-5
MAX_CACHE_SALT_CHARS = 256
# Bounds on the client-controlled token lists (OpenAI's logit_bias, vLLM's
# allowed_token_ids and bad_words), so no request makes the sampler's per-step
# work or the wire frame unbounded.
MAX_LOGIT_BIAS = 1024
MAX_LOGIT_BIAS_VALUE = 100.0
MAX_ALLOWED_TOKEN_IDS = 65536
MAX_BAD_WORDS = 128
MAX_BAD_WORD_CHARS = 256
# per tokenized bad word (each word has up to two forms): byte-level BPE may take
# a token per UTF-8 byte, plus one for a leading space
MAX_BAD_WORD_TOKENS = 4 * MAX_BAD_WORD_CHARS + 1


class RequestOutputKind(enum.IntEnum):
    """What each streamed `RequestOutput` carries."""

    CUMULATIVE = 0  # everything generated so far
    DELTA = 1  # only what is new since the last output
    FINAL_ONLY = 2  # nothing until the request finishes


def _require(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ConfigError(f"SamplingParams.{name}={value!r} is invalid: must be {allowed}")


@dataclass
class SamplingParams:
    """How to sample one request. Invalid values raise `ConfigError` naming the field."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Mixed into the prefix-cache key of the prompt's first block: requests share
    # cached KV blocks only when their salts are equal (None is a salt of its own).
    cache_salt: str | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the token's logit before penalties and sampling (OpenAI's).
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be sampled (vLLM's); None: all.
    allowed_token_ids: list[int] | None = None
    # Words never to generate (vLLM's): a word's last token is banned whenever
    # the output ends with the tokens before it.
    bad_words: list[str] | None = None
    # `bad_words` tokenized (with and without a leading space, as vLLM does) by
    # the front end, which has the tokenizer; what the engine core reads.
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False)
    # Normalised forms, derived in __post_init__.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for rule in _RULES:  # each field's own constraint, as declared below
            value = getattr(self, rule.name)
            if not rule.check(value):
                shown = value if rule.shown is None else rule.shown(value)
                _require(False, rule.name, shown, rule.allowed)
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        self.stop_strings = _normalise_stop(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        try:
            self.output_kind = RequestOutputKind(self.output_kind)
        except ValueError:
            raise ConfigError(
                f"SamplingParams.output_kind={self.output_kind!r} is invalid: must be one of "
                "RequestOutputKind.CUMULATIVE, DELTA or FINAL_ONLY"
            ) from None

    @property
    def greedy(self) -> bool:
        """Greedy requests skip the random part of sampling entirely: temperature 0
        (or below 1e-5, as in vLLM) or top_k 1."""
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must apply logit bias, allowed tokens or bad words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def clone(self, **changes: object) -> SamplingParams:
        """A validated copy with some fields changed (used to fan `n > 1` out)."""
        fields = {
            name: getattr(self, name)
            for name in self.__dataclass_fields__
            if self.__dataclass_fields__[name].init
        }
        fields.update(changes)
        return SamplingParams(**fields)  # type: ignore[arg-type]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_num(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _encodable(text: str) -> bool:
    """Whether `text` is valid Unicode (no lone surrogates), as the wire needs."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _clip(value: object) -> object:
    """`value` for an error message: long strings are cut, so a client's oversized
    input is not echoed back whole."""
    if isinstance(value, str) and len(value) > 40:
        return value[:37] + "..."
    return value


def _normalise_stop(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise ConfigError(
            f"SamplingParams.stop={stop!r} is invalid: must be None, a non-empty string "
            "or a list of non-empty strings"
        )
    return list(stop)


@dataclass(frozen=True, slots=True)
class _Rule:
    """One field's constraint: `check(value)` holds, else ConfigError saying the
    value must be `allowed` (the value shown through `shown`, when given)."""

    name: str
    check: Callable[[Any], bool]
    allowed: str
    shown: Callable[[Any], object] | None = None


def _token_ids(value: object) -> bool:
    return value is None or (
        isinstance(value, list | tuple) and all(_is_int(t) and t >= 0 for t in value)
    )


def _salt(value: object) -> bool:
    return value is None or (
        isinstance(value, str) and 0 < len(value) <= MAX_CACHE_SALT_CHARS and _encodable(value)
    )


def _logit_bias(value: object) -> bool:
    return value is None or (
        isinstance(value, dict)
        and len(value) <= MAX_LOGIT_BIAS
        and all(
            _is_int(t) and t >= 0 and _is_num(b) and abs(b) <= MAX_LOGIT_BIAS_VALUE
            for t, b in value.items()
        )
    )


def _allowed_token_ids(value: object) -> bool:
    return value is None or (
        isinstance(value, list | tuple)
        and 0 < len(value) <= MAX_ALLOWED_TOKEN_IDS
        and _token_ids(value)
    )


def _bad_words(value: object) -> bool:
    return value is None or (
        isinstance(value, list | tuple)
        and len(value) <= MAX_BAD_WORDS
        and all(
            isinstance(w, str) and 0 < len(w) <= MAX_BAD_WORD_CHARS and _encodable(w) for w in value
        )
    )


def _bad_words_token_ids(value: object) -> bool:
    return value is None or (
        isinstance(value, list | tuple)
        and len(value) <= 2 * MAX_BAD_WORDS
        and all(
            isinstance(w, list | tuple) and 0 < len(w) <= MAX_BAD_WORD_TOKENS and _token_ids(w)
            for w in value
        )
    )


def _logprobs_rule(name: str) -> _Rule:
    return _Rule(
        name,
        lambda v: v is None or (_is_int(v) and 0 <= v <= _MAX_LOGPROBS),
        f"None or an integer in [0, {_MAX_LOGPROBS}]",
    )


def _penalty_rule(name: str) -> _Rule:
    return _Rule(name, lambda v: _is_num(v) and -2.0 <= v <= 2.0, "in [-2, 2]")


def _bool_rule(name: str) -> _Rule:
    return _Rule(name, lambda v: isinstance(v, bool), "a bool")


# Every field's own constraint, checked in this order by `__post_init__` (the one
# constraint between fields, min_tokens <= max_tokens, is checked after them).
_RULES: tuple[_Rule, ...] = (
    _Rule("n", lambda v: _is_int(v) and v >= 1, "an integer >= 1"),
    _Rule("max_tokens", lambda v: v is None or (_is_int(v) and v >= 1), "None or an integer >= 1"),
    _Rule("min_tokens", lambda v: _is_int(v) and v >= 0, "an integer >= 0"),
    _Rule(
        "temperature",
        lambda v: _is_num(v) and 0.0 <= v <= 100.0,
        "a number in [0, 100] (0 means greedy)",
    ),
    _Rule("top_p", lambda v: _is_num(v) and 0.0 < v <= 1.0, "in (0, 1]"),
    _Rule(
        "top_k",
        lambda v: _is_int(v) and (v == -1 or v >= 0),
        "an integer >= 1, or 0 / -1 to disable",
    ),
    _Rule("min_p", lambda v: _is_num(v) and 0.0 <= v <= 1.0, "in [0, 1]"),
    _Rule(
        "seed",
        lambda v: v is None or (_is_int(v) and 0 <= v <= _UINT64_MAX),
        "None or an integer in [0, 2**64 - 1]",
    ),
    _Rule("stop_token_ids", _token_ids, "None or a list of non-negative token ids"),
    _logprobs_rule("logprobs"),
    _logprobs_rule("prompt_logprobs"),
    _Rule(
        "repetition_penalty",
        lambda v: _is_num(v) and 0.0 < v <= 10.0,
        "in (0, 10] (1 means no penalty)",
    ),
    _penalty_rule("frequency_penalty"),
    _penalty_rule("presence_penalty"),
    _bool_rule("include_stop_str_in_output"),
    _bool_rule("ignore_eos"),
    _bool_rule("skip_special_tokens"),
    _bool_rule("spaces_between_special_tokens"),
    _Rule(
        "cache_salt",
        _salt,
        f"None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        shown=_clip,
    ),
    _Rule(
        "structured_outputs",
        lambda v: v is None or isinstance(v, StructuredOutputsParams),
        "None or a StructuredOutputsParams",
        shown=lambda v: _clip(repr(v)),
    ),
    _Rule(
        "logit_bias",
        _logit_bias,
        f"None or a dict of at most {MAX_LOGIT_BIAS} token ids (integers >= 0) to biases "
        f"in [-{MAX_LOGIT_BIAS_VALUE:g}, {MAX_LOGIT_BIAS_VALUE:g}]",
        shown=lambda v: _clip(repr(v)),
    ),
    _Rule(
        "allowed_token_ids",
        _allowed_token_ids,
        f"None or a non-empty list of at most {MAX_ALLOWED_TOKEN_IDS} token ids (integers >= 0)",
        shown=lambda v: _clip(repr(v)),
    ),
    _Rule(
        "bad_words",
        _bad_words,
        f"None or a list of at most {MAX_BAD_WORDS} non-empty strings of at most "
        f"{MAX_BAD_WORD_CHARS} characters",
        shown=lambda v: _clip(repr(v)),
    ),
    _Rule(
        "bad_words_token_ids",
        _bad_words_token_ids,
        f"None or a list of at most {2 * MAX_BAD_WORDS} lists of 1 to {MAX_BAD_WORD_TOKENS} "
        "token ids",
        shown=lambda v: _clip(repr(v)),
    ),
)
