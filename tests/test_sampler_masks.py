"""Allowed-token bitmasks in the CPU sampler kernel (structured output): the
kernel masks each constrained row as it reads it, and must sample exactly as if
the disallowed logits had been set to -inf first (tokens, logprobs and ranks),
with every other row untouched; and draw the same tokens as the torch path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_sampler import make_md

from asyncllm import _core
from asyncllm.worker.input_batch import F_MIN_P, F_TEMPERATURE, I_GREEDY, I_NUM_LOGPROBS, I_TOP_K
from asyncllm.worker.sampler_kernel import sample_cpu
from asyncllm.worker.sampler_torch import sample_torch
from asyncllm.worker.sampling_metadata import SamplingMetadata, TokenLists

VOCAB = 3000  # not a multiple of 32: the last word is partial


def random_masks(m: int, vocab: int, seed: int) -> np.ndarray:
    """[m, words] int32 bitmasks: some rows allow a few tokens, some about half,
    some almost all, as a grammar's masks do, so whole-word and mixed words both
    occur."""
    rng = np.random.default_rng(seed)
    words = -(-vocab // 32)
    allowed = np.zeros((m, words * 32), dtype=bool)
    for i in range(m):
        share = (0.002, 0.5, 0.97)[i % 3]
        allowed[i, :vocab] = rng.random(vocab) < share
        allowed[i, rng.integers(vocab)] = True  # never empty
        if i % 4 == 0:  # whole words allowed and disallowed
            allowed[i, 64:128] = True
            allowed[i, 128:192] = False
    packed = np.packbits(allowed, axis=1, bitorder="little")
    return packed.view(np.int32).reshape(m, words).copy()


def set_disallowed(logits: torch.Tensor, rows: np.ndarray, masks: np.ndarray) -> torch.Tensor:
    out = logits.clone()
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")[:, : logits.shape[1]]
    for i, r in enumerate(rows.tolist()):
        out[r, torch.from_numpy(bits[i] == 0)] = float("-inf")
    return out


def varied_md(n: int) -> SamplingMetadata:
    md = make_md(
        n,
        top_p=0.9,
        num_logprobs=4,
        penalties=(1.3, 0.2, 0.1),
        seen=[([5, 70, 300], [2, 0, 1])],
        banned=[[2, 9]],
    )
    md.params_i[::2, I_TOP_K] = 40  # both the top-k and the whole-row paths
    md.params_f[::3, F_MIN_P] = 0.02
    md.params_f[1::4, F_TEMPERATURE] = 0.7
    md.params_i[::5, I_GREEDY] = 1
    md.params_i[3::6, I_NUM_LOGPROBS] = -1
    return md


def test_masked_rows_sample_as_if_disallowed_logits_were_minus_inf():
    n = 48
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    rows = np.array([r for r in range(n) if r % 4 != 1], dtype=np.int64)  # some unconstrained
    masks = random_masks(len(rows), VOCAB, seed=12)
    md = varied_md(n)
    md.allowed = (rows, masks)
    fused = sample_cpu(logits.clone(), md)
    plain = varied_md(n)
    expected = sample_cpu(set_disallowed(logits, rows, masks), plain)
    assert torch.equal(fused.sampled, expected.sampled)
    want = torch.from_numpy(md.num_logprobs >= 0)  # the other rows' entries are unset
    assert fused.logprob_ids is not None and expected.logprob_ids is not None
    assert fused.logprob_values is not None and expected.logprob_values is not None
    assert fused.logprob_ranks is not None and expected.logprob_ranks is not None
    assert torch.equal(fused.logprob_ids[want], expected.logprob_ids[want])
    assert torch.equal(fused.logprob_ranks[want], expected.logprob_ranks[want])
    values, expected_values = fused.logprob_values[want], expected.logprob_values[want]
    assert torch.equal(values.isnan(), expected_values.isnan())
    assert torch.equal(values.nan_to_num(), expected_values.nan_to_num())
    # every constrained row drew an allowed token
    bits = np.unpackbits(masks.view(np.uint8), axis=1, bitorder="little")
    for i, r in enumerate(rows.tolist()):
        assert bits[i, int(fused.sampled[r])] == 1


def test_masked_kernel_and_torch_draw_the_same_tokens():
    n = 200
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(n, VOCAB, generator=g) * 2
    rows = np.arange(0, n, 2, dtype=np.int64)
    masks = random_masks(len(rows), VOCAB, seed=14)
    md = make_md(n)
    md.allowed = (rows, masks)
    ours = sample_cpu(logits.clone(), md).sampled
    md = make_md(n)
    md.allowed = (rows, masks)
    theirs = sample_torch(logits.clone(), md).sampled
    # draws in the same (index) order: rounding may move one on a boundary
    assert (ours == theirs).float().mean() > 0.98


def test_a_row_alone_draws_what_it_draws_in_a_batch():
    n = 64
    g = torch.Generator().manual_seed(15)
    logits = torch.randn(n, VOCAB, generator=g) * 3
    rows = np.arange(n, dtype=np.int64)
    masks = random_masks(n, VOCAB, seed=16)
    md = varied_md(n)
    md.allowed = (rows, masks)
    batched = sample_cpu(logits, md).sampled
    for r in range(0, n, 7):
        one = varied_md(n)
        alone = SamplingMetadata(
            False,
            one.params_f[r : r + 1],
            one.params_i[r : r + 1],
            TokenLists(np.array([0, 3]), np.array([5, 70, 300]), np.array([2, 0, 1])),
            TokenLists(np.array([0, 2]), np.array([2, 9]), np.array([0, 0])),
            4,
            (np.zeros(1, dtype=np.int64), masks[r : r + 1]),
        )
        assert int(sample_cpu(logits[r : r + 1], alone).sampled[0]) == int(batched[r])


def test_bad_bitmask_arguments_raise_value_errors():
    n, vocab = 3, 100
    logits = np.zeros((n, vocab), dtype=np.float32)
    f = np.ones((n, 6), dtype=np.float32)
    f[:, 4:] = 0.0
    i = np.zeros((n, 6), dtype=np.int64)
    i[:, 2] = -1
    off = np.zeros(n + 1, dtype=np.int64)
    none = np.zeros(0, dtype=np.int64)
    out = (np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64))
    width = (np.zeros((n, 0), dtype=np.int64), np.zeros((n, 0), dtype=np.float32))
    base = (logits, f, i, off, none, none, off, none, *out, *width, 1)
    good = np.full((2, 4), -1, dtype=np.int32)

    def call(bitmask, rows):
        return _core._sample(*base, bitmask, rows)

    assert call(good, np.array([0, 2])) == []
    with pytest.raises(ValueError, match="given together"):
        call(good, None)
    with pytest.raises(ValueError, match="out of range or listed twice"):
        call(good, np.array([0, 3]))
    with pytest.raises(ValueError, match="out of range or listed twice"):
        call(good, np.array([1, 1]))
    with pytest.raises(ValueError, match="too few rows"):
        call(good, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="does not cover vocab 100"):
        call(np.full((2, 3), -1, dtype=np.int32), np.array([0, 1]))
    with pytest.raises(ValueError, match="int32"):
        call(good.astype(np.int64), np.array([0, 1]))
