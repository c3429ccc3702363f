"""The runner's side of constrained decoding: one grammar matcher per running
constrained request (each child of an `n > 1` request its own), the step's
allowed-token bitmask for the constrained rows being sampled (one Rust call, the
GIL released, rows in parallel), and the advance of every matcher by its sampled
token (one more call). The runner starts the fill on a helper thread before the
forward pass and waits for it just before sampling, so the masks are computed
while the model runs; the advance follows the draw. Both belong to one step of
the runner's thread, so the mask of step N+1 always follows the token of step N,
with or without overlap scheduling.

A matcher follows the request's tokens, not its blocks: a request that resumes
after preemption (or finds its prompt in the prefix cache) gets a fresh matcher
that consumes the outputs it already has, so nothing is consumed twice.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asyncllm import _core
from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.grammar_cache import GrammarCache


class GrammarRows:
    def __init__(self, cache: GrammarCache, max_num_seqs: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.matchers: dict[int, _core.GrammarMatcher] = {}
        self._bitmask: np.ndarray | None = None  # [max_num_seqs, words] int32, reused
        self._pool: ThreadPoolExecutor | None = None  # the fill beside the forward pass

    def add(self, new: NewRequestData) -> None:
        if new.grammar is None:
            return
        matcher = new.grammar.matcher()
        outputs = new.token_ids[new.num_prompt_tokens :]
        if outputs:  # resumed: replay what it generated before
            matcher.consume(outputs)
        self.matchers[new.req_id] = matcher

    def remove(self, req_id: int) -> None:
        self.matchers.pop(req_id, None)

    def bitmask(self, req_ids: list[int]) -> tuple[np.ndarray, np.ndarray] | None:
        """For the rows of `req_ids` (the step's sampled requests, in order): the
        indices of the constrained ones and their bitmask rows [m, words] int32;
        None when none is constrained."""
        matchers = self.matchers
        idx = [i for i, rid in enumerate(req_ids) if rid in matchers]
        if not idx:
            return None
        compiler = self.cache.compiler
        if self._bitmask is None:
            self._bitmask = np.zeros((self.max_num_seqs, compiler.words), dtype=np.int32)
        m = len(idx)
        compiler.fill_bitmasks([matchers[req_ids[i]] for i in idx], self._bitmask, list(range(m)))
        return np.asarray(idx, dtype=np.int64), self._bitmask[:m]

    def bitmask_async(
        self, req_ids: list[int]
    ) -> Future[tuple[np.ndarray, np.ndarray] | None] | None:
        """`bitmask` on the helper thread (the GIL is released while it fills);
        None when no row of `req_ids` is constrained."""
        matchers = self.matchers
        if not any(rid in matchers for rid in req_ids):
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(self.bitmask, req_ids)

    def advance(self, req_ids: list[int], sampled: list[int], rows: np.ndarray) -> None:
        """Consume each constrained row's sampled token (`rows` as `bitmask`
        returned them)."""
        idx = rows.tolist()
        self.cache.compiler.advance(
            [self.matchers[req_ids[i]] for i in idx], [sampled[i] for i in idx]
        )
