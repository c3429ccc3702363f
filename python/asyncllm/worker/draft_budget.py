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
# The most drafts whose expected rate is within this share of the best: the
# estimates are noisy and near the top the curve is flat (SmolLM2 GGUF, batch 1,
# editing: 2 drafts 72 tok/s against 4 drafts 76 by the fit), and more drafts keep
# the later positions' acceptance observed.
SLACK = 0.03
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
        drafted = num_drafts > 0
        count = int(np.count_nonzero(drafted))
        if count == 0:
            return
        d, a = num_drafts[drafted], num_accepted[drafted]
        # position j was reached by the requests with min(a + 1, d) > j, and
        # accepted by those with a > j: counts of each, summed from the top
        k = self.k
        reached = np.bincount(np.minimum(a + 1, d), minlength=k + 1)[::-1].cumsum()[::-1]
        took = np.bincount(a, minlength=k + 1)[::-1].cumsum()[::-1]
        decay = (1.0 - FORGET) ** count
        self._reached = self._reached * decay + reached[1 : k + 1]
        self._accepted = self._accepted * decay + took[1 : k + 1]

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
        # expected tokens per second with d drafts each: the accepted prefix's
        # expected length is the sum over j <= d of P(the first j all accepted)
        gains, reach = [0.0], 1.0
        for took, reached in zip(self._accepted.tolist(), self._reached.tolist(), strict=True):
            reach *= min(took / max(reached, 1e-9), 1.0)
            gains.append(gains[-1] + reach)
        rates = [
            (num_rows + num_proposing * gain) / max(t0 + t1 * (num_rows + num_proposing * d), 1e-9)
            for d, gain in enumerate(gains)
        ]
        top = max(rates)
        best = max(d for d, rate in enumerate(rates) if rate >= top * (1.0 - SLACK))
        if best > 0:
            self._since_drafts = 0
            return best
        self._since_drafts += 1
        if self._since_drafts >= EXPLORE_EVERY:
            self._since_drafts = 0
            return self.k
        return 0
