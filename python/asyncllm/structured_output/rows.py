"""The runner's side of constrained decoding: one grammar matcher per running
constrained request (each child of an `n > 1` request its own), the step's
allowed-token bitmask for the constrained rows being sampled (one Rust call, the
GIL released; rows whose matchers are in the same state share one mask), and the
advance of every matcher by its sampled token.

Right after a step's draw the runner hands the sampled tokens to the extension's
grammar thread (`GrammarCompiler.advance_fill`), which advances those matchers and
at once fills their next masks: the next step most likely samples the same
requests, so their masks are computed while the engine handles this step's
outputs and schedules the next, on the core that torch's threads leave idle
between two forward passes. That thread never takes the GIL: a Python helper
thread had to wait for it to start and between the advance and the fill, and its
fill slid into the forward pass. The runner waits for the masks just before
sampling; rows the fill ahead did not cover (a request new to sampling, or resumed
with a fresh matcher) are filled by a job queued after it. The mask of step N+1
always follows the token of step N: the grammar thread runs its jobs in order, and
nothing else touches a matcher meanwhile.

Where to fill was measured on a 2-core box (benches/history/2026-11-30_to_2026-12-01.md,
"constrained decoding within 10 %"): ahead of the step as here, then beside the forward pass,
then serially on the runner's thread before it, in that order. The fill runs
serially on the grammar thread unless spare cores exist, since more threads only
take the forward's cores from it. The sampler applies the masks as it reads each
row (`_core._sample`'s bitmask): no separate pass over the logits.

A matcher follows the request's tokens, not its blocks: a request that resumes
after preemption (or finds its prompt in the prefix cache) gets a fresh matcher
that consumes the outputs it already has, so nothing is consumed twice.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from asyncllm import _core
from asyncllm.structured_output.grammar_cache import GrammarCache


class NewConstrainedRequest(Protocol):
    """What `GrammarRows.add` reads of a request the runner has not seen (the
    scheduler's `NewRequestData`): its grammar, if any, and its tokens so far."""

    req_id: int
    grammar: Any
    token_ids: list[int]
    num_prompt_tokens: int


def fill_threads() -> int:
    """Threads for the mask fill: the cores torch's own threads leave free, at
    least one (the grammar thread itself, serially)."""
    import torch  # loaded already: only a model runner fills masks

    return max(1, (os.cpu_count() or 1) - torch.get_num_threads())


class StepMasks:
    """One step's masks, being filled: `result()` waits for the fill and gives
    (indices of the constrained rows [m] int64, their bitmask rows [m, words]
    int32), the form `SamplingMetadata.allowed` takes."""

    def __init__(
        self,
        jobs: list[_core.MaskJob],
        idx: list[int],
        buf: np.ndarray,
        gather: np.ndarray | None,
    ) -> None:
        self._jobs = jobs
        self._idx = idx
        self._buf = buf
        self._gather = gather  # buffer row of each constrained row; None: 0..m-1

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        for job in self._jobs:
            job.wait()
        m = len(self._idx)
        bitmask = self._buf[:m] if self._gather is None else self._buf[self._gather]
        return np.asarray(self._idx, dtype=np.int64), bitmask


# (buffer row of each request filled ahead, its matcher then, the fill)
_Ahead = tuple[dict[int, int], list[_core.GrammarMatcher], _core.MaskJob]


class GrammarRows:
    def __init__(self, cache: GrammarCache, max_num_seqs: int) -> None:
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.matchers: dict[int, _core.GrammarMatcher] = {}
        self.threads = fill_threads()
        # [2 * max_num_seqs, words] int32, reused: rows filled ahead, then the rest
        self._buf: np.ndarray | None = None
        self._ahead: _Ahead | None = None

    def add(self, new: NewConstrainedRequest) -> None:
        if new.grammar is None:
            return
        matcher = new.grammar.matcher()
        outputs = new.token_ids[new.num_prompt_tokens :]
        if outputs:  # resumed: replay what it generated before
            matcher.consume(outputs)
        self.matchers[new.req_id] = matcher

    def remove(self, req_id: int) -> None:
        # a job that holds its matcher still runs, harmlessly: nothing reads it
        self.matchers.pop(req_id, None)

    def bitmask_async(self, req_ids: list[int]) -> StepMasks | None:
        """The masks of the constrained rows among `req_ids` (the step's sampled
        requests, in order); None when none is constrained. Rows filled ahead
        (`advance`) are taken as they are; the rest (a request new to sampling,
        or resumed with a fresh matcher) are filled by a job queued after the
        fill ahead, while the forward pass runs."""
        matchers = self.matchers
        idx = [i for i, rid in enumerate(req_ids) if rid in matchers]
        if not idx:
            return None
        buf = self._buffer()
        ahead, self._ahead = self._ahead, None
        jobs: list[_core.MaskJob] = []
        src = [-1] * len(idx)
        base = 0
        if ahead is not None:
            where, filled, job = ahead
            jobs.append(job)
            base = len(filled)
            for j, i in enumerate(idx):
                k = where.get(req_ids[i], -1)
                if k >= 0 and filled[k] is matchers[req_ids[i]]:  # not a new matcher
                    src[j] = k
        missing = [j for j, k in enumerate(src) if k < 0]
        if missing:
            for n, j in enumerate(missing):
                src[j] = base + n
            ms = [matchers[req_ids[idx[j]]] for j in missing]
            rows = list(range(base, base + len(missing)))
            # the grammar thread runs its jobs in order: this one after the fill ahead
            compiler = self.cache.compiler
            jobs.append(compiler.advance_fill([], [], ms, buf, rows, self.threads))
        gather = None if src == list(range(len(src))) else np.asarray(src, dtype=np.int64)
        return StepMasks(jobs, idx, buf, gather)

    def advance(self, req_ids: list[int], sampled: list[int], rows: np.ndarray) -> None:
        """Each constrained row's sampled token (`rows`: the indices `bitmask_async`
        gave). The grammar thread advances those matchers at once and fills their
        next masks, as the next step most likely samples the same requests: the
        fill runs while the engine handles this step's outputs and schedules the
        next."""
        idx = rows.tolist()
        ms = [self.matchers[req_ids[i]] for i in idx]
        tokens = [sampled[i] for i in idx]
        where = {req_ids[i]: k for k, i in enumerate(idx)}
        job = self.cache.compiler.advance_fill(
            ms, tokens, ms, self._buffer(), list(range(len(ms))), self.threads
        )
        self._ahead = (where, ms, job)

    def _buffer(self) -> np.ndarray:
        if self._buf is None:
            words = self.cache.compiler.words
            self._buf = np.zeros((2 * self.max_num_seqs, words), dtype=np.int32)
        return self._buf
