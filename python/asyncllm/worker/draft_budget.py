"""How many drafts a step verifies per request: as many as pay for themselves on
this machine now.

Verifying d drafts gives a request 1 + (expected accepted) tokens for the step,
but the step runs its forward on d more rows. Where the forward is bound by the
weight read (a GPU, a CPU at batch 1 in bf16) extra rows are nearly free; where it
is bound by compute (int8 GGUF kernels on AVX2 at 16 streams: 80 rows cost ~5x 16)
verification loses to plain decoding (0.84x sampled, issue 29). So the budget keeps
two estimates, both updated every step, and picks the draft cap that maximises
expected tokens per second:

- the step's cost in seconds as `t0 + t1 * rows`, a least-squares fit over recent
  steps of decodes and drafts (exponentially forgotten, so it follows load;
  prompt chunks run other kernels at another cost per row), one fit per batch
  size (requests in the step, in powers of two): a step of one request is bound
  by its weight read, one of 16 by compute, and a single line through both
  priced a lone request's drafts at the compute-bound rate (SmolLM2 GGUF, Zen
  5: 16 streams then one gave 1.56x where one stream alone gave 1.80x);
- each draft position's acceptance given the one before it was accepted, per
  request (its own recent verifications at that position, with its rate over
  all positions as the prior, and the all-request rate as that one's): an
  editing request copying its prompt and a chat one with nothing to copy in
  the same batch get the drafts each pays for, a lone request's estimate
  follows its own text within a few steps (a shared one, decayed once a step
  at batch 1, kept the last workload's rate for tens of steps), and positions
  a request's caps have not reached yet are expected to go as its others do.

The caps maximise the step's expected tokens per second over every request's
draft positions at once: a position's gain is the probability that it and
every one before it are accepted, its cost one row; for a given number of
rows the best are those of the highest gains, so the positions are ranked by
gain and the best prefix of the ranking is taken. Each request's share is a
prefix of its own positions (its gains fall with the position).

Until the fit has seen two row counts it allows every draft (optimistic: the
acceptance estimates need drafts to learn). Where it settles on no drafts, every
`EXPLORE_EVERY`-th step still proposes about k drafts in all (the full k for a
lone request, `k // n` each for n <= k, one each for k of more requests, the
next k at the next exploration), so a change in the text or the machine is
noticed at the cost of a few rows: the full k for each of 16 streams had made
that step 144 rows, ~7x a plain one, and one each 32 rows, ~2x where 16 streams
are compute-bound (SmolLM2 GGUF, Zen 5). Where the first
positions pay, the caps climb to the later ones by themselves. Outputs are the
same whatever cap runs: only speed changes.
"""

from __future__ import annotations

import numpy as np

from asyncllm import _core

# The weight a new observation has against everything before it.
FORGET = 0.05
# With no drafts allowed, every this many steps proposes about k drafts anyway.
EXPLORE_EVERY = 32
# Past the best rate, positions whose gain falls short of paying for their row
# by at most this share are taken too: the estimates are noisy and near the top
# the curve is flat (SmolLM2 GGUF, batch 1, editing: 2 drafts 72 tok/s against
# 4 drafts 76 by the fit), and more drafts keep the later positions' acceptance
# observed.
SLACK = 0.1
# Acceptance assumed per position before any verification (a prior of this many
# drafts at this rate).
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 4.0
# A request's own estimate: its verifications forgotten at this rate each, and
# the all-request rate weighing as this many of them.
ROW_FORGET, ROW_PRIOR_WEIGHT = 0.2, 2.0


class DraftBudget:
    """The draft cap of each request for the next step (`caps`), from the
    observed step times (`observe_step`) and verification outcomes
    (`observe_verified`) of the runner's batch rows (`num_rows` of them;
    `reset` when a row's request changes)."""

    def __init__(self, k: int, num_rows: int) -> None:
        self.k = k
        # per batch-size bucket (`_bucket`): decayed sums for the fit
        # time = t0 + t1 * rows [w, x, y, xx, xy], and the first row counts seen;
        # plain floats, not arrays: this runs every step, and a numpy scalar's
        # conversions had cost more than the arithmetic
        self._sums: dict[int, list[float]] = {}
        self._rows_seen: dict[int, set[int]] = {}
        # over all requests and positions: decayed counts of drafts reached and
        # accepted; per batch row and position, the same
        self._reached = PRIOR_WEIGHT * k
        self._accepted = PRIOR_WEIGHT * PRIOR_RATE * k
        self._row_reached = np.zeros((num_rows, k))
        self._row_accepted = np.zeros((num_rows, k))
        self._positions = np.arange(k)
        self._since_drafts = 0
        self._explored = 0  # where the next exploration of many requests starts

    def reset(self, row: int) -> None:
        """Batch row `row` holds another request: forget its acceptance."""
        self._row_reached[row] = 0.0
        self._row_accepted[row] = 0.0

    def observe_step(self, requests: int, rows: int, seconds: float) -> None:
        """A step of `requests` requests and `rows` tokens took `seconds`
        (forward, sampling, proposal)."""
        bucket = _bucket(requests)
        sums = self._sums.get(bucket)
        if sums is None:
            sums = self._sums[bucket] = [0.0] * 5
        keep = 1.0 - FORGET
        new = (1.0, float(rows), seconds, float(rows * rows), rows * seconds)
        for i in range(5):
            sums[i] = sums[i] * keep + new[i]
        seen = self._rows_seen.setdefault(bucket, set())
        if len(seen) < 2:
            seen.add(rows)

    def observe_verified(
        self, rows: np.ndarray, num_drafts: np.ndarray, num_accepted: np.ndarray
    ) -> None:
        """The drafts of the requests at batch rows `rows` and how many of them
        were accepted (a prefix)."""
        drafted = num_drafts > 0
        count = int(np.count_nonzero(drafted))
        if count == 0:
            return
        d, a, rows = num_drafts[drafted], num_accepted[drafted], rows[drafted]
        # position j was reached by a request with min(a + 1, d) > j, and
        # accepted by one with a > j
        hit = np.minimum(a + 1, d)
        reached = self._positions < hit[:, None]
        took = self._positions < a[:, None]
        decay = (1.0 - FORGET) ** count
        self._reached = self._reached * decay + int(hit.sum())
        self._accepted = self._accepted * decay + int(a.sum())
        self._row_reached[rows] = self._row_reached[rows] * (1.0 - ROW_FORGET) + reached
        self._row_accepted[rows] = self._row_accepted[rows] * (1.0 - ROW_FORGET) + took

    def cost(self, requests: int) -> tuple[float, float] | None:
        """(t0, t1) of the fitted time of a step of `requests` requests, or None
        while it cannot be fitted."""
        bucket = _bucket(requests)
        if len(self._rows_seen.get(bucket, ())) < 2:
            return None
        w, x, y, xx, xy = self._sums[bucket]
        var = w * xx - x * x
        if var <= 1e-9 * max(w * xx, 1e-30):
            return None
        # noise can tilt the slope below 0: extra rows are then free
        t1 = max((w * xy - x * y) / var, 0.0)
        return max((y - t1 * x) / w, 0.0), t1

    def caps(self, num_rows: int, proposing: np.ndarray) -> np.ndarray:
        """The most drafts each request at batch rows `proposing` may verify in
        a step of `num_rows` requests."""
        n = len(proposing)
        fit = self.cost(num_rows)
        if n == 0 or fit is None:
            return np.full(n, self.k, dtype=np.int64)
        t0, t1 = fit
        overall = self._accepted / max(self._reached, 1e-9)
        # P(position j accepted | the ones before it were): the request's own
        # counts at j, with its rate over all positions as the prior (so a
        # request whose drafts were all accepted expects the same of positions
        # its caps have not reached yet), that one with `overall`; the positions
        # ranked by gain, the best prefix taken (rust/spec/budget.rs: one call
        # where a dozen numpy ones had cost ~175 µs a step at batch 1)
        caps = _core._draft_caps(
            self._row_accepted,
            self._row_reached,
            proposing,
            overall,
            ROW_PRIOR_WEIGHT,
            t0,
            t1,
            num_rows,
            SLACK,
        )
        best = sum(caps)
        if best > 0:
            self._since_drafts = 0
            return np.array(caps, dtype=np.int64)
        self._since_drafts += 1
        if self._since_drafts >= EXPLORE_EVERY:
            self._since_drafts = 0
            if n <= self.k:
                return np.full(n, self.k // n, dtype=np.int64)
            # one draft each for k of them, the next k at the next exploration
            some = np.zeros(n, dtype=np.int64)
            some[(self._explored + np.arange(self.k)) % n] = 1
            self._explored = (self._explored + self.k) % n
            return some
        return np.zeros(n, dtype=np.int64)


def _bucket(requests: int) -> int:
    """The batch-size bucket of a step of `requests` requests: 1, 2-3, 4-7, ..."""
    return max(requests, 1).bit_length()
