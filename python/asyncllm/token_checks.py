"""The checks every layer applies to a request's token ids and its `max_tokens`,
written once: the front end validates with them before a request leaves, and the
engine core re-checks with the same functions (it may be driven directly)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from asyncllm.errors import InvalidRequestError

if TYPE_CHECKING:
    from asyncllm.sampling_params import SamplingParams


def first_bad_token_id(ids: Iterable[object], vocab_size: int) -> object | None:
    """The first entry of `ids` that is not an int in [0, vocab_size), else None."""
    for t in ids:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            return t
    return None


def check_token_ids(ids: Iterable[object], vocab_size: int, param: str) -> None:
    """Raises InvalidRequestError naming `param` (the public name: `prompt`,
    `stop_token_ids`, `tokens`) when an id is outside the vocabulary."""
    bad = first_bad_token_id(ids, vocab_size)
    if bad is not None:
        shown = repr(bad) if len(repr(bad)) <= 40 else repr(bad)[:40] + "..."
        raise InvalidRequestError(
            f"{param} contains {shown}, which is not a token id in [0, {vocab_size})"
        )


def check_params_token_ids(p: SamplingParams, vocab_size: int) -> None:
    """Every token id a request's parameters carry — stop tokens, logit_bias's
    keys, allowed_token_ids, the tokenized bad words — against the vocabulary:
    the sampler indexes the logits with them."""
    check_token_ids(p.stop_token_ids or (), vocab_size, "stop_token_ids")
    check_token_ids(p.logit_bias or (), vocab_size, "logit_bias")
    check_token_ids(p.allowed_token_ids or (), vocab_size, "allowed_token_ids")
    for word in p.bad_words_token_ids or ():
        check_token_ids(word, vocab_size, "bad_words")


def max_tokens_room(prompt_len: int, max_model_len: int) -> int:
    """How many tokens a prompt of `prompt_len` leaves room for in the context."""
    return max_model_len - prompt_len


def clamp_max_tokens(max_tokens: int | None, prompt_len: int, max_model_len: int) -> int:
    """The max_tokens a request runs with: its own (None: all the room left),
    never past the context, and at least 1 (the core always generates one)."""
    room = max_tokens_room(prompt_len, max_model_len)
    wanted = room if max_tokens is None else min(max_tokens, room)
    return max(wanted, 1)
