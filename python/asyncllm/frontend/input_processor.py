"""Turns what a user passes as a prompt into token ids, checked before anything
reaches the engine core."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_output.grammar_cache import GrammarCache
from asyncllm.token_checks import check_params_token_ids, check_token_ids

_UINT64_MAX = 2**64 - 1  # the largest seed SamplingParams accepts

# A prompt: text, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}
PromptType = str | Sequence[int] | Mapping[str, Any]


class InputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        # Compiles output constraints so a bad one fails here, naming the problem;
        # built on the first constrained request (the EOS id does not change
        # whether a constraint compiles).
        eos = tokenizer.eos_token_id
        self.grammars = GrammarCache(tokenizer.path, [0 if eos is None else eos], vocab_size)

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
        """What SamplingParams cannot check alone: token ids against the vocabulary,
        and the seeds of the `n` children `fan_out` derives (seed .. seed + n - 1),
        so that a request fails here, before any child reaches the core. Also
        tokenizes `bad_words` into `bad_words_token_ids` (the core has no tokenizer)."""
        if params.bad_words:
            params.bad_words_token_ids = bad_words_token_ids(self.tokenizer, params.bad_words)
        check_params_token_ids(params, self.vocab_size)
        if params.seed is not None and params.seed + params.n - 1 > _UINT64_MAX:
            raise InvalidRequestError(
                f"seed={params.seed} with n={params.n} is invalid: the n choices use seeds "
                f"seed .. seed + n - 1, so seed must be <= 2**64 - n"
            )
        if params.structured_outputs is not None:
            # Rust with the GIL released; cached, so the core's compile of the same
            # constraint in another process is the only other one
            self.grammars.compile(params.structured_outputs)

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
        check_token_ids(out, self.vocab_size, "prompt")
        return out


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word's token ids as it would start the text and as it would follow
    a space (the second only when it tokenizes differently but to as many
    tokens), as vLLM's `SamplingParams.update_from_tokenizer` does."""
    out: list[list[int]] = []
    for word in words:
        bare, spaced = tokenizer.encode_batch(
            [word.lstrip(), " " + word.lstrip()], add_special_tokens=False
        )
        if bare:
            out.append(bare)
        if spaced and (not bare or (spaced[0] != bare[0] and len(spaced) == len(bare))):
            out.append(spaced)
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
