"""Speculative decoding's configuration, with vLLM's names: the validated form of
`EngineArgs.speculative_config` (a dict, or its JSON text on the command line).

`{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
"prompt_lookup_max": 5}`: prompt lookup over each request's own prompt and output
(rust/spec/ngram.rs). "suffix" and "draft_model" are vLLM's other methods; they are
named here so that asking for one fails with a clear error, not an unknown key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError

METHODS = ("ngram",)
NOT_IMPLEMENTED = ("suffix", "draft_model", "eagle", "eagle3", "medusa", "mlp_speculator")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64  # rust/spec/ngram.rs MAX_N
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max")


def _fail(key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(
        f"EngineArgs.speculative_config[{key!r}]={value!r} is invalid: must be {allowed}"
    )


def _int_in(spec: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(key, value, f"an integer in [{low}, {high}]")
    return value


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """The configuration `value` (None, a dict or its JSON text) names; raises
        ConfigError naming the key, its value and what is allowed."""
        if value is None:
            return None
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ConfigError(
                    f"EngineArgs.speculative_config is not valid JSON: {e.msg} at {e.pos}"
                ) from None
        if not isinstance(value, dict):
            raise ConfigError(
                f"EngineArgs.speculative_config={value!r} is invalid: must be None, a dict "
                "or its JSON text"
            )
        unknown = sorted(str(k) for k in value if k not in _KEYS and k != "model")
        if unknown:
            raise ConfigError(
                f"EngineArgs.speculative_config has unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(_KEYS)}"
            )
        method = value.get("method", "ngram")
        if method in NOT_IMPLEMENTED:
            raise _fail(
                "method", method, f"one of {', '.join(METHODS)} ({method} is not implemented)"
            )
        if method not in METHODS:
            raise _fail("method", method, f"one of {', '.join(METHODS)}")
        if "model" in value:
            raise _fail("model", value["model"], "absent with method 'ngram'")
        if "num_speculative_tokens" not in value:
            raise ConfigError(
                "EngineArgs.speculative_config needs 'num_speculative_tokens' "
                f"(an integer in [1, {MAX_SPECULATIVE_TOKENS}])"
            )
        k = _int_in(value, "num_speculative_tokens", 0, 1, MAX_SPECULATIVE_TOKENS)
        low = _int_in(value, "prompt_lookup_min", 2, 1, MAX_LOOKUP)
        high = _int_in(value, "prompt_lookup_max", max(low, 5), low, MAX_LOOKUP)
        return cls(method, k, low, high)

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _KEYS}
