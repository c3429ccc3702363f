"""A request as the engine core sees it: token ids, progress and its stop state."""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Iterable
from typing import Any

from asyncllm._core import block_hash_root, hash_blocks
from asyncllm.sampling_params import SamplingParams
from asyncllm.token_checks import clamp_max_tokens

# A block's identity in the prefix cache: a SHA-256 digest (32 bytes) chained over
# every block before it and the request's cache salt (layout in rust/prefix_hash.rs).
# Equal keys mean equal (salt, prefix) unless SHA-256 collides, so a hit is exact by
# design, and a tenant cannot aim at another's blocks without knowing its salt.
BlockHash = bytes

# The parent of the first block of every request without a cache salt.
_UNSALTED_ROOT = block_hash_root(None)
# An adapter's requests chain from SHA-256(this || the salt's root || its key): they
# share blocks only with requests of the same adapter and salt. The domain's first
# bytes are no digest, so this input is never a block link's (parent || ids).
_LORA_DOMAIN = b"asyncllm prefix-cache lora root v1\0"


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    """One sequence in the engine core.

    `all_token_ids` is the prompt followed by the generated tokens;
    `num_computed_tokens` counts the leading tokens whose K/V sit in the cache (with
    overlap scheduling: or are being computed by a step already scheduled).
    `block_hashes` holds the prefix-cache key of every full block of
    `all_token_ids`; the prompt's are computed here, at construction (in one native
    call, off the busy loop and without the GIL for long prompts), so the busy loop
    only ever hashes the one block a decode step fills.
    """

    __slots__ = (
        "request_id",
        "prompt_token_ids",
        "sampling_params",
        "all_token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "max_tokens",
        "stop_token_ids",
        "status",
        "stop_reason",
        "arrival_time",
        "priority",
        "block_size",
        "block_hashes",
        "num_preemptions",
        "num_cached_prompt_tokens",
        "max_num_tokens",
        "num_output_placeholders",
        "grammar",
        "spec_token_ids",
        "pooling",
        "lora",
    )

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: Iterable[int],
        max_model_len: int,
        block_size: int,
        hash_blocks: bool,
        arrival_time: float = 0.0,
        priority: int = 0,
        pooling: str | None = None,
        lora: Any = None,
    ) -> None:
        self.request_id = request_id
        # its adapter (`lora.adapters.LoadedAdapter`: `cache_key` keys its blocks),
        # or None for the base model
        self.lora = lora
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.max_tokens = clamp_max_tokens(
            sampling_params.max_tokens, self.num_prompt_tokens, max_model_len
        )
        # the length at which it stops for max_tokens: one compare per decode
        self.max_num_tokens = self.num_prompt_tokens + self.max_tokens
        stops = set(sampling_params.stop_token_ids or ())
        # a constrained request ends at the EOS its grammar allows only at its end
        if not sampling_params.ignore_eos or sampling_params.structured_outputs is not None:
            stops.update(eos_token_ids)
        self.stop_token_ids = frozenset(stops)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.arrival_time = arrival_time
        self.priority = priority
        self.block_size = block_size
        self.block_hashes: list[BlockHash] | None = [] if hash_blocks else None
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0
        # Overlap scheduling: tokens scheduled to be sampled whose ids are not known
        # yet (counted as computed-but-unknown, as vLLM's placeholders); 0 otherwise.
        self.num_output_placeholders = 0
        # the compiled output constraint (`_core.Grammar`), set by the engine core
        self.grammar: Any = None
        # Speculative decoding: the draft tokens proposed after the last step,
        # verified by the next one (empty: none, or speculation is off).
        self.spec_token_ids: list[int] = []
        # An embedding request ("last" or "mean" pooling): it finishes when its
        # prompt is computed, with its pooled hidden state and no token.
        self.pooling = pooling
        self.hash_full_blocks()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def check_stop(self, token_id: int) -> bool:
        """Called after `token_id` was appended; marks the request finished if it
        must stop here. Returns whether it did."""
        n_out = self.num_output_tokens
        # a constrained request's sampler lets a stop token through before
        # min_tokens only where its grammar allows nothing else: the grammar wins
        if token_id in self.stop_token_ids and (
            n_out > self.sampling_params.min_tokens or self.grammar is not None
        ):
            self.status = RequestStatus.FINISHED_STOPPED
            self.stop_reason = token_id
            return True
        if n_out >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def hash_full_blocks(self) -> None:
        """Append the prefix-cache key of every full block not hashed yet."""
        hashes = self.block_hashes
        if hashes is None:
            return
        size = self.block_size
        start = len(hashes) * size
        tokens = self.all_token_ids
        if len(tokens) - start < size:
            return
        if hashes:
            parent = hashes[-1]
        else:
            salt = self.sampling_params.cache_salt
            parent = _UNSALTED_ROOT if salt is None else block_hash_root(salt)
            if self.lora is not None:
                key = self.lora.cache_key.encode()
                parent = hashlib.sha256(_LORA_DOMAIN + parent + key).digest()
        hashes.extend(hash_blocks(parent, tokens[start:], size))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
