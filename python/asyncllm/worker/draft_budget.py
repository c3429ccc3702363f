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
  steps of decodes and drafts (exponentially forgotten, so it follows load and
  batch changes; prompt chunks run other kernels at another cost per row);
- each draft position's acceptance given the one before it was accepted.

Until the fit has seen two row counts it allows every draft (optimistic: the
acceptance estimates need drafts to learn). Where it settles on no drafts, every
`EXPLORE_EVERY`-th step still proposes the full k, so a change in the text or the
machine is noticed. Outputs are the same whatever cap runs: only speed changes.
"""

from __future__ import annotations

import numpy as np

# The weight a new observation has against everything before it.
FORGET = 0.05
# With no drafts allowed, every this many steps proposes the full k anyway.
EXPLORE_EVERY = 32
# Acceptance assumed per position before any verification (a prior of this many
# drafts at this rate).
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 4.0


class DraftBudget:
    """The draft cap per request for the next step (`cap`), from the observed
    step times (`observe_step`) and verification outcomes (`observe_verified`)."""

    def __init__(self, k: int) -> None:
        self.k = k
        # decayed sums for the fit time = t0 + t1 * rows: w, x, y, xx, xy
        self._sums = np.zeros(5)
        self._rows_seen: set[int] = set()
        # per draft position: decayed counts of reached and accepted
        self._reached = np.full(k, PRIOR_WEIGHT)
        self._accepted = np.full(k, PRIOR_WEIGHT * PRIOR_RATE)
        self._since_drafts = 0

    def observe_step(self, rows: int, seconds: float) -> None:
        """A step of `rows` tokens took `seconds` (forward, sampling, proposal)."""
        self._sums *= 1.0 - FORGET
        self._sums += (1.0, rows, seconds, rows * rows, rows * seconds)
        if len(self._rows_seen) < 2:
            self._rows_seen.add(rows)

    def observe_verified(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """Each request's drafts and how many of them were accepted (a prefix)."""
        drafted = num_drafts[num_drafts > 0]
        if drafted.size == 0:
            return
        accepted = num_accepted[num_drafts > 0]
        pos = np.arange(self.k)
        # position j was reached if every draft before it was accepted, and exists
        reached = ((pos[None, :] <= accepted[:, None]) & (pos[None, :] < drafted[:, None])).sum(0)
        took = (pos[None, :] < accepted[:, None]).sum(0)
        decay = (1.0 - FORGET) ** drafted.size
        self._reached = self._reached * decay + reached
        self._accepted = self._accepted * decay + took

    def cost(self) -> tuple[float, float] | None:
        """(t0, t1) of the fitted step time, or None while it cannot be fitted."""
        w, x, y, xx, xy = (float(v) for v in self._sums)
        var = w * xx - x * x
        if len(self._rows_seen) < 2 or var <= 1e-9 * max(w * xx, 1e-30):
            return None
        # noise can tilt the slope below 0: extra rows are then free
        t1 = max((w * xy - x * y) / var, 0.0)
        return max((y - t1 * x) / w, 0.0), t1

    def cap(self, num_rows: int, num_proposing: int) -> int:
        """The most drafts each of `num_proposing` requests may verify in a step
        of `num_rows` requests."""
        if num_proposing == 0:
            return self.k
        fit = self.cost()
        if fit is None:
            return self.k
        t0, t1 = fit
        # expected extra tokens of d drafts: sum over j <= d of P(first j accepted)
        rate = np.clip(self._accepted / np.maximum(self._reached, 1e-9), 0.0, 1.0)
        gain = np.concatenate(([0.0], np.cumsum(np.cumprod(rate))))
        d = np.arange(self.k + 1)
        tokens = num_rows + num_proposing * gain
        seconds = np.maximum(t0 + t1 * (num_rows + num_proposing * d), 1e-9)
        best = int(np.argmax(tokens / seconds))
        if best > 0:
            self._since_drafts = 0
            return best
        self._since_drafts += 1
        if self._since_drafts >= EXPLORE_EVERY:
            self._since_drafts = 0
            return self.k
        return 0
