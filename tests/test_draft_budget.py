"""The draft budget (asyncllm.worker.draft_budget): as many drafts per request as
pay for themselves, from the step times and acceptances it observes."""

from __future__ import annotations

import numpy as np

from asyncllm.worker.draft_budget import EXPLORE_EVERY, DraftBudget


def _budget(k: int, t0: float, t1: float, accept: float, steps: int = 40) -> DraftBudget:
    """A budget that saw steps costing t0 + t1 * rows (16 requests, with and
    without k drafts each) and drafts accepted at `accept` per position."""
    b = DraftBudget(k)
    rng = np.random.default_rng(0)
    for i in range(steps):
        rows = 16 * (1 + (k if i % 2 else 0))
        b.observe_step(rows, t0 + t1 * rows)
        drafts = np.full(16, k)
        # a prefix accepted: position j reached with accept^j, taken with accept
        accepted = np.minimum(rng.geometric(1 - accept, 16) - 1, k)
        b.observe_verified(drafts, accepted)
    return b


def test_every_draft_while_the_cost_is_unknown() -> None:
    b = DraftBudget(4)
    assert b.cap(16, 16) == 4
    b.observe_step(16, 0.01)
    b.observe_step(16, 0.011)  # one row count: no slope yet
    assert b.cost() is None and b.cap(16, 16) == 4


def test_a_memory_bound_step_verifies_every_draft() -> None:
    """Extra rows nearly free (a weight read dominates): all k drafts."""
    b = _budget(4, t0=0.010, t1=0.00001, accept=0.7)
    t0, t1 = b.cost() or (0, 0)
    assert abs(t0 - 0.010) < 1e-6 and abs(t1 - 0.00001) < 1e-8
    assert b.cap(16, 16) == 4


def test_a_compute_bound_step_verifies_none_but_explores() -> None:
    """Each row costing the same (int8 kernels on AVX2 at 16 streams) and half the
    drafts rejected: no drafts, except every EXPLORE_EVERY-th step, which
    proposes the full k so the estimates stay current."""
    b = _budget(4, t0=0.0, t1=0.001, accept=0.5)
    caps = [b.cap(16, 16) for _ in range(EXPLORE_EVERY)]
    assert caps[:-1] == [0] * (EXPLORE_EVERY - 1) and caps[-1] == 4


def test_the_cap_falls_between_where_late_drafts_rarely_land() -> None:
    """A fixed cost and a per-row one of the same order: a few drafts pay, the
    last positions (reached rarely) do not."""
    b = _budget(8, t0=0.016, t1=0.001, accept=0.6)
    assert 0 < b.cap(16, 16) < 8


def test_rejections_at_the_first_position_stop_the_drafts() -> None:
    """Acceptance falls to nothing: even cheap rows are not worth verifying."""
    b = _budget(4, t0=0.010, t1=0.0005, accept=0.7)
    assert b.cap(16, 16) > 0
    for _ in range(200):
        b.observe_verified(np.full(16, 4), np.zeros(16, dtype=np.int64))
    assert b.cap(16, 16) == 0


def test_the_fit_follows_the_machine() -> None:
    """Steps grow 10x dearer per row (another process took the cores): the fit
    forgets the old steps and the cap falls."""
    b = _budget(4, t0=0.010, t1=0.00001, accept=0.6)
    assert b.cap(16, 16) == 4
    for i in range(200):
        rows = 16 * (1 + (4 if i % 2 else 0))
        b.observe_step(rows, 0.0 + 0.002 * rows)
    assert b.cap(16, 16) == 0
