"""Speculative decoding in the scheduler: how many drafts a request may verify in
a step, applying what verification accepted, and vLLM's acceptance counters.

A step that verifies `d` drafts of a decoding request computes its last token and
the drafts (1 + d query tokens) and samples 1 + a tokens: the `a` accepted drafts
and the token drawn after them. The K/V of the d - a rejected drafts sits past
the request's computed tokens: `num_computed_tokens` is rolled back over them,
and the next step writes over their slots (the blocks stay with the request,
which needs them for its next drafts; only computed, accepted tokens ever fill a
block the prefix cache shares).
"""

from __future__ import annotations

from asyncllm.core.request import Request


class SpecDecodeStats:
    """vLLM's `spec_decode_*` counters, over the engine's life."""

    __slots__ = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos")

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # [i]: drafts whose token at position i was accepted
        self.accepted_per_pos = [0] * num_speculative_tokens

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        per_pos = self.accepted_per_pos
        for i in range(num_accepted):
            per_pos[i] += 1

    def report(self) -> dict[str, int | list[int]]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
        }


def fit_drafts(request: Request, drafts: list[int], num_new: int, budget: int) -> list[int]:
    """The drafts a running request verifies this step: none unless it decodes
    (its one new token is its last sampled one), and no more than the token
    budget left and its `max_tokens` allow (every token a step samples is kept,
    so a step never samples past the limit)."""
    if num_new != 1 or request.num_output_placeholders:
        return []
    room = min(request.max_num_tokens - request.num_tokens - 1, budget - 1)
    if room <= 0:
        return []
    return drafts if len(drafts) <= room else drafts[:room]


def apply_verified(
    request: Request, num_drafts: int, tokens: list[int], stats: SpecDecodeStats
) -> tuple[int, bool]:
    """After a step computed the request's last token and `num_drafts` drafts and
    sampled `tokens` (the accepted drafts, then one more): roll back the rejected
    drafts, append the tokens up to a stop, and count the acceptance. Returns the
    number of tokens appended and whether the request finished."""
    num_accepted = len(tokens) - 1
    request.num_computed_tokens -= num_drafts - num_accepted
    stats.observe(num_drafts, num_accepted)
    all_tokens = request.all_token_ids
    appended = 0
    finished = False
    for token in tokens:
        all_tokens.append(token)
        appended += 1
        if (len(all_tokens) >= request.max_num_tokens or token in request.stop_token_ids) and (
            request.check_stop(token)
        ):
            finished = True
            break
    if request.block_hashes is not None:
        request.hash_full_blocks()
    return appended, finished
