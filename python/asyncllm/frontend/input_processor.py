"""Turns what a user passes as a prompt into token ids, checked before anything
reaches the engine core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.sampling_params import SamplingParams

# A prompt: text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}
PromptType = str | Sequence[int] | Mapping[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    def process(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """(prompt text or None, prompt token ids); raises InvalidRequestError."""
        text: str | None
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
            elif isinstance(prompt.get("prompt"), str):
                text = prompt["prompt"]
                ids = self.tokenizer.encode(text)
            else:
                raise InvalidRequestError(
                    "a prompt dict needs 'prompt_token_ids' (a list of ints) or 'prompt' (a string)"
                )
        elif isinstance(prompt, Sequence):
            text, ids = None, self._check_ids(prompt)
        else:
            raise InvalidRequestError(
                f"prompt of type {type(prompt).__name__} is not supported: pass a string, a list "
                "of token ids or a dict with 'prompt_token_ids'"
            )
        self.check_length(ids)
        return text, ids

    def check_params(self, params: SamplingParams) -> None:
        """What SamplingParams cannot check alone: token ids against the vocabulary."""
        for t in params.stop_token_ids or ():
            if t >= self.vocab_size:
                raise InvalidRequestError(
                    f"SamplingParams.stop_token_ids contains {t}, outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )

    def check_length(self, ids: list[int]) -> None:
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(ids)} tokens but max_model_len={self.max_model_len} "
                f"allows at most {self.max_model_len - 1} (one token must remain to generate)"
            )

    def _check_ids(self, ids: Any) -> list[int]:
        if not isinstance(ids, Sequence) or isinstance(ids, str | bytes):
            raise InvalidRequestError("prompt_token_ids must be a list of ints")
        out = list(ids)
        for t in out:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise InvalidRequestError(
                    f"prompt token id {t!r} is not an int in [0, {self.vocab_size})"
                )
        return out


def fan_out(params: SamplingParams) -> list[SamplingParams]:
    """The parameters of each core request behind one user request: itself for
    n == 1, else n children with n=1 and, when seeded, seeds seed, seed+1, ... so the
    children differ but the whole request stays reproducible."""
    if params.n == 1:
        return [params]
    return [
        params.clone(n=1, seed=None if params.seed is None else params.seed + i)
        for i in range(params.n)
    ]
