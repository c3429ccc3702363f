"""The draft budget (asyncllm.worker.draft_budget): as many drafts per request as
pay for themselves, from the step times and acceptances it observes."""

from __future__ import annotations

import numpy as np
import pytest

from asyncllm import _core
from asyncllm.worker.draft_budget import (
    EXPLORE_EVERY,
    ROW_PRIOR_WEIGHT,
    SLACK,
    DraftBudget,
)

ALL = np.arange(16)


def _verify(
    b: DraftBudget, rows: np.ndarray, k: int, accept: float, rng: np.random.Generator
) -> None:
    """Drafts of k tokens at `rows`, a prefix accepted: position j reached with
    accept^j, taken with accept."""
    accepted = np.minimum(rng.geometric(1 - accept, len(rows)) - 1, k)
    b.observe_verified(rows, np.full(len(rows), k), accepted)


def _budget(k: int, t0: float, t1: float, accept: float, steps: int = 40) -> DraftBudget:
    """A budget that saw steps costing t0 + t1 * rows (16 requests, with and
    without k drafts each) and drafts accepted at `accept` per position."""
    b = DraftBudget(k, 32)
    rng = np.random.default_rng(0)
    for i in range(steps):
        rows = 16 * (1 + (k if i % 2 else 0))
        b.observe_step(16, rows, t0 + t1 * rows)
        _verify(b, ALL, k, accept, rng)
    return b


def test_every_draft_while_the_cost_is_unknown() -> None:
    b = DraftBudget(4, 16)
    assert (b.caps(16, ALL) == 4).all()
    b.observe_step(16, 16, 0.01)
    b.observe_step(16, 16, 0.011)  # one row count: no slope yet
    assert b.cost(16) is None and (b.caps(16, ALL) == 4).all()


def test_a_memory_bound_step_verifies_every_draft() -> None:
    """Extra rows nearly free (a weight read dominates): all k drafts."""
    b = _budget(4, t0=0.010, t1=0.00001, accept=0.7)
    t0, t1 = b.cost(16) or (0, 0)
    assert abs(t0 - 0.010) < 1e-6 and abs(t1 - 0.00001) < 1e-8
    assert (b.caps(16, ALL) == 4).all()


def test_a_compute_bound_step_verifies_none_but_explores() -> None:
    """Each row costing the same (int8 kernels on AVX2 at 16 streams) and half the
    drafts rejected: no drafts, except every EXPLORE_EVERY-th step, which
    proposes about k drafts in all (one each for k of 16 requests, the next k
    the next time; the full k for one) so the estimates stay current."""
    b = _budget(4, t0=0.0, t1=0.001, accept=0.5)
    caps = [b.caps(16, ALL).tolist() for _ in range(EXPLORE_EVERY)]
    assert caps[:-1] == [[0] * 16] * (EXPLORE_EVERY - 1)
    assert caps[-1] == [1] * 4 + [0] * 12
    explored = [b.caps(16, ALL) for _ in range(EXPLORE_EVERY)]
    assert explored[-1].tolist() == [0] * 4 + [1] * 4 + [0] * 8
    caps = [b.caps(16, ALL[:2]).tolist() for _ in range(EXPLORE_EVERY)]
    assert caps[-1] == [2, 2]
    caps = [b.caps(16, ALL[:1]).tolist() for _ in range(EXPLORE_EVERY)]
    assert caps[-1] == [4]


def test_the_cap_falls_between_where_late_drafts_rarely_land() -> None:
    """A fixed cost and a per-row one of the same order: a few drafts pay, the
    last positions (reached rarely) do not."""
    b = _budget(8, t0=0.016, t1=0.001, accept=0.6)
    caps = b.caps(16, ALL)
    assert caps.sum() > 0 and caps.max() < 8


def test_rejections_at_the_first_position_stop_the_drafts() -> None:
    """Acceptance falls to nothing: even cheap rows are not worth verifying."""
    b = _budget(4, t0=0.010, t1=0.0005, accept=0.7)
    assert b.caps(16, ALL).sum() > 0
    for _ in range(200):
        b.observe_verified(ALL, np.full(16, 4), np.zeros(16, dtype=np.int64))
    assert (b.caps(16, ALL) == 0).all()


def test_the_fit_follows_the_machine() -> None:
    """Steps grow 10x dearer per row (another process took the cores): the fit
    forgets the old steps and the cap falls."""
    b = _budget(4, t0=0.010, t1=0.00001, accept=0.6)
    assert (b.caps(16, ALL) == 4).all()
    for i in range(200):
        rows = 16 * (1 + (4 if i % 2 else 0))
        b.observe_step(16, rows, 0.0 + 0.002 * rows)
    assert (b.caps(16, ALL) == 0).all()


def test_each_batch_size_keeps_its_own_cost() -> None:
    """16 requests a step compute-bound, then one request alone whose extra rows
    are nearly free (its step reads the weights once either way): the lone
    request verifies every draft at once, priced by its own steps, not by a line
    through the 16-request ones; and the 16-request caps are what they were."""
    b = _budget(4, t0=0.0, t1=0.001, accept=0.5)
    lone = np.array([20])  # a row of its own: the all-request acceptance
    assert b.cost(1) is None and b.caps(1, lone).tolist() == [4]  # nothing seen yet
    for i in range(40):
        rows = 1 + (4 if i % 2 else 0)
        b.observe_step(1, rows, 0.004 + 0.0001 * rows)
    t0, t1 = b.cost(1) or (0, 0)
    assert abs(t0 - 0.004) < 1e-6 and abs(t1 - 0.0001) < 1e-7
    assert b.caps(1, lone).tolist() == [4]
    assert (b.caps(16, ALL) == 0).all()


def test_each_request_gets_the_drafts_its_own_acceptance_pays_for() -> None:
    """Half the batch copies its prompt (every draft accepted), half has nothing
    to copy (every draft rejected), on a step where a row costs a tenth of the
    fixed part: the copying requests verify every draft, the others none; a
    request that joins a row starts from the all-request estimate."""
    b = DraftBudget(8, 32)
    copying, chatting = np.arange(8), np.arange(8, 16)
    for i in range(40):
        rows = 16 + (64 if i % 2 else 0)
        b.observe_step(16, rows, 0.010 + 0.0005 * rows)
        b.observe_verified(copying, np.full(8, 8), np.full(8, 8))
        b.observe_verified(chatting, np.full(8, 8), np.zeros(8, dtype=np.int64))
    caps = b.caps(16, ALL)
    assert (caps[:8] == 8).all() and (caps[8:] == 0).all()
    b.reset(12)  # as a row no request has used (20)
    fresh = np.concatenate((np.arange(12), [20], np.arange(13, 16)))
    assert (b.caps(16, ALL) == b.caps(16, fresh)).all()


def _reference_caps(
    took: np.ndarray, reached: np.ndarray, overall: float, t0: float, t1: float, num_rows: int
) -> np.ndarray:
    """The caps in numpy, as the budget computed them before the extension did."""
    n, k = took.shape
    own = (took.sum(axis=1) + ROW_PRIOR_WEIGHT * overall) / (reached.sum(axis=1) + ROW_PRIOR_WEIGHT)
    rate = (took + ROW_PRIOR_WEIGHT * own[:, None]) / (reached + ROW_PRIOR_WEIGHT)
    gains = np.cumprod(np.minimum(rate, 1.0), axis=1).ravel()
    order = np.argsort(-gains, kind="stable")
    tokens = num_rows + np.concatenate(([0.0], np.cumsum(gains[order])))
    rates = tokens / np.maximum(t0 + t1 * (num_rows + np.arange(len(order) + 1)), 1e-9)
    best = int(np.argmax(rates))
    best = max(best, int(np.count_nonzero(gains[order] >= rates[best] * t1 * (1.0 - SLACK))))
    return np.bincount(order[:best] // k, minlength=n)


def test_the_extensions_caps_are_the_numpy_ranking() -> None:
    rng = np.random.default_rng(7)
    for case in range(300):
        rows, k = int(rng.integers(1, 33)), int(rng.integers(1, 9))
        reached = rng.uniform(0, 6, (rows, k)) * (rng.random((rows, k)) < 0.9)
        took = reached * rng.uniform(0, 1, (rows, k))
        proposing = rng.permutation(rows)[: int(rng.integers(1, rows + 1))]
        overall = float(rng.uniform(0, 1))
        t0, t1 = float(rng.uniform(1e-3, 2e-2)), float(rng.uniform(0, 2e-3))
        num_rows = int(rng.integers(1, 33))
        got = _core._draft_caps(
            took, reached, proposing, overall, ROW_PRIOR_WEIGHT, t0, t1, num_rows, SLACK
        )
        want = _reference_caps(took[proposing], reached[proposing], overall, t0, t1, num_rows)
        assert got == want.tolist(), case


def test_the_caps_reject_a_row_out_of_range() -> None:
    counts = np.zeros((4, 8))
    with pytest.raises(ValueError, match="proposing holds row 4"):
        _core._draft_caps(counts, counts, np.array([4]), 0.5, 2.0, 1e-3, 1e-4, 1, 0.1)
    with pytest.raises(ValueError, match="reached has shape"):
        _core._draft_caps(counts, np.zeros((4, 7)), np.array([0]), 0.5, 2.0, 1e-3, 1e-4, 1, 0.1)
