"""Token rules — logit_bias, allowed_token_ids, bad_words — through the runner's
real sampling path (InputBatch rows -> build_sampling_metadata -> Sampler), on
the CPU kernel and on the torch sampler, plus their validation and the bad-word
tokenization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.errors import ConfigError
from asyncllm.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from asyncllm.worker import sampler as sampler_module
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.sampler import Sampler
from asyncllm.worker.sampler_torch import sample_torch
from asyncllm.worker.sampling_metadata import build_sampling_metadata
from asyncllm.worker.token_rules import merge_allowed, row_token_rules

VOCAB = 50
CPU = torch.device("cpu")


class TorchSampler(Sampler):
    """The Sampler with the torch path on CPU logits (CUDA's sampler, run here)."""

    def __call__(self, logits, md):  # type: ignore[no-untyped-def]
        saved = sampler_module.sample_cpu
        sampler_module.sample_cpu = sample_torch  # type: ignore[assignment]
        try:
            return super().__call__(logits, md)
        finally:
            sampler_module.sample_cpu = saved


SAMPLERS = {"kernel": Sampler, "torch": TorchSampler}


def batch_of(params: list[SamplingParams], outputs: list[list[int]] | None = None) -> InputBatch:
    """An InputBatch with one row per params: prompt [1, 2], then `outputs[i]`."""
    ib = InputBatch(max_num_seqs=8, max_model_len=64, max_blocks_per_req=4)
    for i, p in enumerate(params):
        out = [] if outputs is None else outputs[i]
        stops = frozenset(p.stop_token_ids or ())
        ib.add(NewRequestData(i, [1, 2, *out], 2, p, [i], 2 + len(out), stops))
    return ib


def sample(ib: InputBatch, logits: torch.Tensor, which: str) -> list[int]:
    rows = np.arange(logits.shape[0])
    md = build_sampling_metadata(ib, rows, VOCAB, CPU)
    out = SAMPLERS[which](engine_seed=5)(logits, md)
    return out.sampled.tolist()  # type: ignore[no-any-return]


def logits_of(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, VOCAB), generator=g) * 3


@pytest.mark.parametrize("which", SAMPLERS)
def test_logit_bias_plus_100_forces_a_token(which: str) -> None:
    logits = logits_of(4)
    weakest = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0.0, logit_bias={weakest: 100.0}),
        SamplingParams(temperature=1.0, seed=3, logit_bias={weakest: 100.0}),
        SamplingParams(temperature=0.0),  # no rules: its own argmax
        SamplingParams(temperature=0.0, logit_bias={int(logits[3].argmax()): -100.0}),
    ]
    got = sample(batch_of(params), logits, which)
    assert got[0] == weakest and got[1] == weakest
    assert got[2] == int(logits[2].argmax())
    assert got[3] == int(logits[3].topk(2).indices[1])  # the best is pushed below the second


@pytest.mark.parametrize("which", SAMPLERS)
def test_bias_is_added_before_the_penalties(which: str) -> None:
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 10], logits[0, 11] = 4.75, 1.0
    # token 11 is in the output once: 1.0 + 4.0 - presence 0.5 = 4.5 < 4.75
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={11: 4.0})
    assert sample(batch_of([p], [[11]]), logits, which) == [10]
    p = SamplingParams(temperature=0.0, presence_penalty=0.5, logit_bias={11: 4.5})
    assert sample(batch_of([p], [[11]]), logits, which) == [11]


@pytest.mark.parametrize("which", SAMPLERS)
def test_allowed_token_ids_restrict_every_draw(which: str) -> None:
    allowed = [3, 17, 41]
    params = [SamplingParams(temperature=1.5, seed=i, allowed_token_ids=allowed) for i in range(6)]
    params.append(SamplingParams(temperature=0.0, allowed_token_ids=[29]))
    params.append(SamplingParams(temperature=0.0))  # unrestricted beside them
    drawn: set[int] = set()
    for step in range(25):
        logits = logits_of(len(params), seed=step)
        got = sample(batch_of(params), logits, which)
        drawn.update(got[:6])
        assert got[6] == 29
        assert got[7] == int(logits[7].argmax())
    assert drawn == set(allowed)  # each allowed one is drawn, nothing else


@pytest.mark.parametrize("which", SAMPLERS)
def test_bad_words_are_never_completed(which: str) -> None:
    logits = torch.zeros((3, VOCAB))
    logits[:, 7] = 10.0  # the greedy choice, unless banned
    logits[:, 8] = 9.0
    bad = [[7], [30, 31, 8]]  # 7 always; 8 only after 30, 31
    p = SamplingParams(temperature=0.0, bad_words_token_ids=bad)
    ib = batch_of([p, p, p], [[], [30, 31], [31, 30]])
    got = sample(ib, logits, which)
    assert got[0] == 8  # 7 banned; 8 starts no bad word's end here
    assert got[1] not in (7, 8)  # the output ends with 30, 31: 8 would finish the word
    assert got[2] == 8  # 31, 30 is not the word's prefix


def test_bad_words_bans_join_min_tokens_bans() -> None:
    logits = torch.zeros((1, VOCAB))
    logits[0, 2], logits[0, 7], logits[0, 8] = 10.0, 9.0, 8.0
    p = SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=[2], bad_words_token_ids=[[7]])
    for which in SAMPLERS:
        assert sample(batch_of([p]), logits, which) == [8]


def test_allowed_tokens_and_a_grammar_mask_intersect() -> None:
    rule = row_token_rules(SamplingParams(allowed_token_ids=[1, 33, 40]))
    assert rule is not None
    grammar_bits = np.zeros((1, 2), dtype=np.uint32)
    grammar_bits[0, 1] = 1 << 1  # token 33 only
    grammar_bits[0, 0] = 1 << 5  # and token 5
    rows, bits = merge_allowed(
        (np.array([0]), grammar_bits.view(np.int32)), [(0, rule), (2, rule)], VOCAB
    )
    assert rows.tolist() == [0, 2]

    def allowed(mask: np.ndarray) -> list[int]:
        return [t for t in range(VOCAB) if mask.view(np.uint32)[t // 32] >> (t % 32) & 1]

    assert allowed(bits[0]) == [33]
    assert allowed(bits[1]) == [1, 33, 40]
    assert grammar_bits[0, 0] == 1 << 5  # the grammar's own array is not written


def test_a_step_without_rules_builds_nothing_for_them() -> None:
    ib = batch_of([SamplingParams(), SamplingParams(temperature=0.0)])
    assert ib.num_token_rules == 0
    md = build_sampling_metadata(ib, np.arange(2), VOCAB, CPU)
    assert md.bias is None and md.allowed_tokens is None and md.banned is None
    ib.add(NewRequestData(9, [1], 1, SamplingParams(logit_bias={1: 1.0}), [5], 1, frozenset()))
    assert ib.num_token_rules == 1
    ib.remove(9)
    assert ib.num_token_rules == 0


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"logit_bias": {1: 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias", ">= 0"),
        (
            {"logit_bias": {i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}},
            "logit_bias",
            f"at most {MAX_LOGIT_BIAS}",
        ),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids", "integers >= 0"),
        ({"bad_words": [""]}, "bad_words", "non-empty strings"),
        ({"bad_words": ["x"] * 129}, "bad_words", "at most 128"),
        ({"bad_words": ["x" * 257]}, "bad_words", "at most 256 characters"),
    ],
)
def test_bad_rules_name_the_field_and_the_limit(kwargs: dict, field: str, limit: str) -> None:
    with pytest.raises(ConfigError) as info:
        SamplingParams(**kwargs)
    assert f"SamplingParams.{field}=" in str(info.value)
    assert limit in str(info.value)
