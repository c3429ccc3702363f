"""The runner's side of constrained decoding: one grammar matcher per running
constrained request (each child of an `n > 1` request its own), the step's
allowed-token bitmask for the constrained rows being sampled (one Rust call, the
GIL released; rows whose matchers are in the same state share one mask), and the
advance of every matcher by its sampled token.

The runner starts the fill on a helper thread before the forward pass and waits
for it just before sampling, so the masks are computed while the model runs. The
advance by the last step's tokens runs first in that same helper task, not on the
runner's thread after the draw: nothing reads a matcher between the draw and the
next fill, so the advance hides behind the forward pass too. The mask of step N+1
still always follows the token of step N, with or without overlap scheduling.

On a CPU the forward pass's threads already hold every core: the fill runs
serially on the helper thread unless spare cores exist, since more threads only
take the forward's cores from it.

A matcher follows the request's tokens, not its blocks: a request that resumes
after preemption (or finds its prompt in the prefix cache) gets a fresh matcher
that consumes the outputs it already has, so nothing is consumed twice.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import numpy as np

from asyncllm import _core
from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.grammar_cache import GrammarCache

if TYPE_CHECKING:  # torch: imported by the runner, not by the core that owns the rows
    from asyncllm.worker.sampling_metadata import SamplingMetadata

# (matchers, tokens): one step's draw, not yet consumed by its matchers
_Advance = tuple[list[_core.GrammarMatcher], list[int]]


def fill_threads() -> int:
    """Threads for the mask fill: the cores torch's own threads leave free, at
    least one (the helper thread itself, serially)."""
    import torch  # loaded already: only a model runner fills masks

    return max(1, (os.cpu_count() or 1) - torch.get_num_threads())


class GrammarRows:
    def __init__(self, cache: GrammarCache, max_num_seqs: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.matchers: dict[int, _core.GrammarMatcher] = {}
        self.threads = fill_threads()
        self._bitmask: np.ndarray | None = None  # [max_num_seqs, words] int32, reused
        self._pool: ThreadPoolExecutor | None = None  # the fill beside the forward pass
        self._pending: list[_Advance] = []  # draws whose advance waits for the next fill

    def add(self, new: NewRequestData) -> None:
        if new.grammar is None:
            return
        matcher = new.grammar.matcher()
        outputs = new.token_ids[new.num_prompt_tokens :]
        if outputs:  # resumed: replay what it generated before
            matcher.consume(outputs)
        self.matchers[new.req_id] = matcher

    def remove(self, req_id: int) -> None:
        # a pending advance of its matcher still runs, harmlessly: nothing reads it
        self.matchers.pop(req_id, None)

    def bitmask(self, req_ids: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """For the rows of `req_ids` (the step's sampled requests, in order): the
        indices of the constrained ones and their bitmask rows [m, words] int32;
        None when none is constrained. Pending advances are consumed first."""
        pending, self._pending = self._pending, []
        return self._fill(pending, req_ids)

    def bitmask_async(
        self, req_ids: list[int]
    ) -> Future[tuple[np.ndarray, np.ndarray] | None] | None:
        """`bitmask` on the helper thread (the GIL is released while it advances
        and fills); None when no row of `req_ids` is constrained."""
        matchers = self.matchers
        if not any(rid in matchers for rid in req_ids):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        pending, self._pending = self._pending, []
        return self._pool.submit(self._fill, pending, req_ids)

    def _fill(
        self, pending: list[_Advance], req_ids: list[int]
    ) -> tuple[np.ndarray, np.ndarray] | None:
        compiler = self.cache.compiler
        for ms, tokens in pending:
            compiler.advance(ms, tokens)
        matchers = self.matchers
        idx = [i for i, rid in enumerate(req_ids) if rid in matchers]
        if not idx:
            return None
        if self._bitmask is None:
            self._bitmask = np.zeros((self.max_num_seqs, compiler.words), dtype=np.int32)
        m = len(idx)
        compiler.fill_bitmasks(
            [matchers[req_ids[i]] for i in idx], self._bitmask, list(range(m)), self.threads
        )
        return np.asarray(idx, dtype=np.int64), self._bitmask[:m]

    def advance(self, req_ids: list[int], sampled: list[int], rows: np.ndarray) -> None:
        """Record each constrained row's sampled token (`rows` as `bitmask`
        returned them); its matcher consumes it at the start of the next fill."""
        idx = rows.tolist()
        self._pending.append(([self.matchers[req_ids[i]] for i in idx], [sampled[i] for i in idx]))


def let_grammar_win(md: SamplingMetadata) -> None:
    """`min_tokens` against a grammar that allows only tokens the row may not take
    yet (its output is complete: only EOS may follow) would leave the row nothing
    to sample. The grammar wins: that row's ban is lifted, it samples EOS, and the
    request finishes with "stop" (the core stops a constrained request on a stop
    token before `min_tokens`: only this lets one through). Both samplers call it;
    rows banned and constrained at once are few, so a loop over them is cheap."""
    if md.allowed is None or md.banned is None:
        return
    from asyncllm.worker.sampling_metadata import TokenLists

    rows, bitmask = md.allowed
    banned = md.banned
    offsets = banned.offsets
    lifted: list[int] = []
    for i, r in enumerate(rows.tolist()):
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        if lo == hi:
            continue
        tokens = banned.tokens[lo:hi]
        bits = np.zeros(bitmask.shape[1], dtype=np.uint32)
        np.bitwise_or.at(bits, tokens // 32, np.left_shift(1, tokens % 32).astype(np.uint32))
        if not (bitmask[i].view(np.uint32) & ~bits).any():
            lifted.append(r)
    if not lifted:
        return
    keep = np.ones(len(offsets) - 1, dtype=bool)
    keep[lifted] = False
    lens = np.diff(offsets) * keep
    new_offsets = np.zeros_like(offsets)
    np.cumsum(lens, out=new_offsets[1:])
    entries = np.repeat(keep, np.diff(offsets))
    md.banned = TokenLists(new_offsets, banned.tokens[entries], banned.counts[entries])
