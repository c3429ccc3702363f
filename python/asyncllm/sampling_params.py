"""Sampling parameters of one request, validated once at construction.

Names and meanings follow vLLM's `SamplingParams` so its users feel at home.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from asyncllm.errors import ConfigError
from asyncllm.structured_outputs import StructuredOutputsParams

_MAX_LOGPROBS = 20
_UINT64_MAX = 2**64 - 1
# Below this temperature a request is greedy, as in vLLM: 1 / temperature would
# overflow float32 on the way to the distribution.
_SAMPLING_EPS = 1e-5
MAX_CACHE_SALT_CHARS = 256


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
    # Normalised forms, derived in __post_init__.
    stop_strings: list[str] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _require(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            "max_tokens",
            self.max_tokens,
            "None or an integer >= 1",
        )
        _require(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            "min_tokens",
            self.min_tokens,
            "an integer >= 0",
        )
        if self.max_tokens is not None:
            _require(
                self.min_tokens <= self.max_tokens,
                "min_tokens",
                self.min_tokens,
                f"<= max_tokens ({self.max_tokens})",
            )
        _require(
            _is_num(self.temperature) and 0.0 <= self.temperature <= 100.0,
            "temperature",
            self.temperature,
            "a number in [0, 100] (0 means greedy)",
        )
        _require(_is_num(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _require(
            _is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 0),
            "top_k",
            self.top_k,
            "an integer >= 1, or 0 / -1 to disable",
        )
        _require(_is_num(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        _require(
            self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= _UINT64_MAX),
            "seed",
            self.seed,
            "None or an integer in [0, 2**64 - 1]",
        )
        self.stop_strings = _normalise_stop(self.stop)
        _require(
            self.stop_token_ids is None
            or (
                isinstance(self.stop_token_ids, list | tuple)
                and all(_is_int(t) and t >= 0 for t in self.stop_token_ids)
            ),
            "stop_token_ids",
            self.stop_token_ids,
            "None or a list of non-negative token ids",
        )
        self.stop_token_ids = list(self.stop_token_ids or [])
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(
                value is None or (_is_int(value) and 0 <= value <= _MAX_LOGPROBS),
                name,
                value,
                f"None or an integer in [0, {_MAX_LOGPROBS}]",
            )
        _require(
            _is_num(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0,
            "repetition_penalty",
            self.repetition_penalty,
            "in (0, 10] (1 means no penalty)",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _require(_is_num(value) and -2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        for name in (
            "include_stop_str_in_output",
            "ignore_eos",
            "skip_special_tokens",
            "spaces_between_special_tokens",
        ):
            value = getattr(self, name)
            _require(isinstance(value, bool), name, value, "a bool")
        _require(
            self.cache_salt is None
            or (
                isinstance(self.cache_salt, str)
                and 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS
                and _encodable(self.cache_salt)
            ),
            "cache_salt",
            _clip(self.cache_salt),
            f"None or a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters",
        )
        _require(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            _clip(repr(self.structured_outputs)),
            "None or a StructuredOutputsParams",
        )
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
