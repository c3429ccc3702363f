"""Speculative decoding's configuration, with vLLM's names: the validated form of
`EngineArgs.speculative_config` (a dict, or its JSON text on the command line).

- `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 2,
  "prompt_lookup_max": 5}`: prompt lookup over each request's own prompt and
  output (rust/spec/ngram.rs).
- `{"method": "suffix", "num_speculative_tokens": k, "suffix_decoding_max_tree_depth":
  24, "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor":
  1.0, "suffix_decoding_min_token_prob": 0.1}`: SuffixDecoding over each request's
  tokens and recent requests' outputs (rust/spec/suffix.rs). vLLM's keys and
  defaults; `suffix_decoding_max_cached_tokens` is ours: vLLM bounds the shared
  outputs by count only, we bound their tokens too (memory grows with them).
  Without `num_speculative_tokens` it drafts up to the tree depth, as vLLM does.
- `{"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`: a
  smaller model with the target's tokenizer (a Hugging Face folder or a GGUF
  file; `check_draft_vocab` compares the vocabularies), run by the target's
  runner with its own KV cache (worker/draft_model.py).

Ours, for every method: `"adaptive_drafts": true` (the default) lets each step
verify only as many drafts as pay for themselves on this machine now
(worker/draft_budget.py); `false` always proposes up to k.

vLLM's other methods are named so that asking for one fails with a clear error,
not an unknown key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from asyncllm.errors import ConfigError

METHODS = ("ngram", "suffix", "draft_model")
NOT_IMPLEMENTED = ("eagle", "eagle3", "medusa", "mlp_speculator")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64  # rust/spec/ngram.rs MAX_N
MAX_TREE_DEPTH = 64  # rust/spec/suffix.rs MAX_DEPTH
_COMMON = ("method", "num_speculative_tokens", "adaptive_drafts")
_KEYS = {
    "ngram": _COMMON + ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": _COMMON
    + (
        "suffix_decoding_max_tree_depth",
        "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_cached_tokens",
        "suffix_decoding_max_spec_factor",
        "suffix_decoding_min_token_prob",
    ),
    "draft_model": _COMMON + ("model",),
}
_ALL_KEYS = sorted({k for keys in _KEYS.values() for k in keys})


def _fail(key: str, value: object, allowed: str) -> ConfigError:
    return ConfigError(
        f"EngineArgs.speculative_config[{key!r}]={value!r} is invalid: must be {allowed}"
    )


def _int_in(spec: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = spec.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(key, value, f"an integer in [{low}, {high}]")
    return value


def _float_in(spec: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = spec.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or not low <= value <= high:
        raise _fail(key, value, f"a number in [{low}, {high}]")
    return float(value)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """A validated speculative-decoding configuration (the fields of other
    methods keep their defaults)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_cached_tokens: int = 65536
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    model: str | None = None  # draft_model: the draft's folder (a GGUF prepared)
    adaptive_drafts: bool = True

    @classmethod
    def parse(cls, value: object) -> SpeculativeConfig | None:
        """The configuration `value` (None, a dict or its JSON text) names; raises
        ConfigError naming the key, its value and what is allowed."""
        if value is None:
            return None
        spec = _as_dict(value)
        unknown = sorted(str(k) for k in spec if k not in _ALL_KEYS)
        if unknown:
            raise ConfigError(
                f"EngineArgs.speculative_config has unknown key(s) {', '.join(unknown)}; "
                f"known: {', '.join(_ALL_KEYS)}"
            )
        method = spec.get("method", "ngram")
        if method in NOT_IMPLEMENTED:
            raise _fail(
                "method", method, f"one of {', '.join(METHODS)} ({method} is not implemented)"
            )
        if method not in METHODS:
            raise _fail("method", method, f"one of {', '.join(METHODS)}")
        for key in spec:
            if key not in _KEYS[method]:
                raise _fail(key, spec[key], f"absent with method {method!r}")
        adaptive = spec.get("adaptive_drafts", True)
        if not isinstance(adaptive, bool):
            raise _fail("adaptive_drafts", adaptive, "true or false")
        return replace(cls._of_method(method, spec), adaptive_drafts=adaptive)

    @classmethod
    def _of_method(cls, method: str, spec: dict[str, Any]) -> SpeculativeConfig:
        if method == "suffix":
            return cls._suffix(spec)
        if method == "draft_model":
            return cls._draft(spec)
        k = _num_speculative_tokens(spec, None)
        low = _int_in(spec, "prompt_lookup_min", 2, 1, MAX_LOOKUP)
        high = _int_in(spec, "prompt_lookup_max", max(low, 5), low, MAX_LOOKUP)
        return cls(method, k, low, high)

    @classmethod
    def _suffix(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        depth = _int_in(spec, "suffix_decoding_max_tree_depth", 24, 2, MAX_TREE_DEPTH)
        return cls(
            "suffix",
            _num_speculative_tokens(spec, min(depth, MAX_SPECULATIVE_TOKENS)),
            suffix_decoding_max_tree_depth=depth,
            suffix_decoding_max_cached_requests=_int_in(
                spec, "suffix_decoding_max_cached_requests", 10000, 0, 1 << 30
            ),
            suffix_decoding_max_cached_tokens=_int_in(
                spec, "suffix_decoding_max_cached_tokens", 65536, 0, 1 << 30
            ),
            suffix_decoding_max_spec_factor=_float_in(
                spec, "suffix_decoding_max_spec_factor", 1.0, 1e-3, 64.0
            ),
            suffix_decoding_min_token_prob=_float_in(
                spec, "suffix_decoding_min_token_prob", 0.1, 0.0, 1.0
            ),
        )

    @classmethod
    def _draft(cls, spec: dict[str, Any]) -> SpeculativeConfig:
        from asyncllm.default_model import resolve_model

        model = spec.get("model")
        if not isinstance(model, str) or not model:
            raise _fail("model", model, "the path of the draft model (a folder or a GGUF file)")
        path = resolve_model(model)
        if not (Path(path) / "config.json").is_file():
            raise _fail("model", model, "a model folder with config.json, or a GGUF file")
        return cls("draft_model", _num_speculative_tokens(spec, None), model=path)

    def to_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in _KEYS[self.method]}


def _as_dict(value: object) -> dict[str, Any]:
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
    return value


def _num_speculative_tokens(spec: dict[str, Any], default: int | None) -> int:
    if "num_speculative_tokens" not in spec and default is None:
        raise ConfigError(
            "EngineArgs.speculative_config needs 'num_speculative_tokens' "
            f"(an integer in [1, {MAX_SPECULATIVE_TOKENS}])"
        )
    return _int_in(spec, "num_speculative_tokens", default or 0, 1, MAX_SPECULATIVE_TOKENS)


def _vocab(folder: str | Path) -> dict[str, int]:
    """The token -> id map of a folder's tokenizer.json (added tokens included)."""
    spec = json.loads((Path(folder) / "tokenizer.json").read_text(encoding="utf-8"))
    vocab = dict(spec.get("model", {}).get("vocab") or {})
    for added in spec.get("added_tokens") or ():
        vocab[added["content"]] = added["id"]
    return vocab


def check_draft_vocab(tokenizer: str | Path, draft: str | Path) -> None:
    """Raise ConfigError unless the draft model's tokenizer maps every token to
    the id the target's does: its proposals are token ids the target verifies."""
    try:
        want, got = _vocab(tokenizer), _vocab(draft)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"speculative_config['model']: cannot read a tokenizer.json: {e}"
        ) from None
    if want != got:
        differ = sorted(set(want.items()) ^ set(got.items()))[:3]
        raise ConfigError(
            f"EngineArgs.speculative_config['model']={str(draft)!r} is invalid: its tokenizer "
            f"differs from the target's ({len(got)} vs {len(want)} tokens; e.g. "
            f"{', '.join(f'{t!r}->{i}' for t, i in differ)}); a draft model must share the "
            "target's vocabulary"
        )
