"""The sampler: the CPU kernel (rust/sampler) and the torch path (CUDA's) against
the torch reference's probabilities by chi-square, draw for draw against each
other, logprobs against log_softmax, non-finite rows, bad arguments, and seeded
requests through the engine (alone, in a batch, after preemption, across runs).

Every draw is keyed by fixed seeds, so the statistical tests are deterministic."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asyncllm import LLM, SamplingParams
from asyncllm.worker.input_batch import (
    F_MIN_P,
    F_TEMPERATURE,
    F_TOP_P,
    I_GREEDY,
    I_NUM_LOGPROBS,
    I_POSITION,
    I_SEED,
    I_TOP_K,
)
from asyncllm.worker.sampler_kernel import sample_cpu
from asyncllm.worker.sampler_torch import masked_logits, random_probs, sample_torch
from asyncllm.worker.sampling_metadata import SamplingMetadata, TokenLists
from tiny_models import make_tiny_model

SEED = 20261201


def make_md(
    n: int,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    penalties: tuple[float, float, float] = (1.0, 0.0, 0.0),
    greedy: bool = False,
    seed: int = SEED,
    num_logprobs: int = -1,
    seen: list[tuple[list[int], list[int]]] | None = None,
    banned: list[list[int]] | None = None,
) -> SamplingMetadata:
    """`n` rows with the same parameters at output positions 0..n-1: n draws."""
    f = np.zeros((n, 6), dtype=np.float32)
    f[:] = (temperature, top_p, min_p, *penalties)
    i = np.zeros((n, 6), dtype=np.int64)
    i[:] = (greedy, top_k, num_logprobs, 0, 0, 0)
    i[:, I_SEED] = np.array(seed, dtype=np.uint64).view(np.int64)  # uint64 bits
    i[:, I_POSITION] = np.arange(n)

    def csr(lists: list[tuple[list[int], list[int]]]) -> TokenLists:
        offsets = np.cumsum([0] + [len(t) for t, _ in lists]).astype(np.int64)
        tokens = np.array([t for ts, _ in lists for t in ts], dtype=np.int64)
        counts = np.array([c for _, cs in lists for c in cs], dtype=np.int64)
        return TokenLists(offsets, tokens, counts)

    return SamplingMetadata(
        all_greedy=greedy,
        params_f=f,
        params_i=i,
        seen=None if seen is None else csr(seen * n),
        banned=None if banned is None else csr([(b, [0] * len(b)) for b in banned] * n),
        max_num_logprobs=None if num_logprobs < 0 else num_logprobs,
    )


def kernel(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    out = sample_cpu(logits, md)
    assert out.nonfinite_rows() == []
    return out.sampled


def torch_path(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    return sample_torch(logits, md).sampled


SAMPLERS = [pytest.param(kernel, id="kernel"), pytest.param(torch_path, id="torch")]


def chi_square_limit(dof: int) -> float:
    """The chi-square quantile at p = 1e-6 (Wilson-Hilferty): beyond chance, so a
    failure means a biased sampler, not bad luck."""
    z = 4.753
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_distribution(draws: torch.Tensor, probs: torch.Tensor) -> None:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    n = len(draws)
    assert counts[probs == 0].sum() == 0, "drew a token of probability 0"
    expected = probs.double() / probs.double().sum() * n  # min-p leaves them unnormalised
    big = expected >= 5
    stat = float(((counts[big] - expected[big]) ** 2 / expected[big]).sum())
    dof = int(big.sum())
    rest_e, rest_o = float(expected[~big].sum()), float(counts[~big].sum())
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        dof += 1
    dof = max(dof - 1, 1)
    assert stat < chi_square_limit(dof), f"chi-square {stat:.1f} over {dof} dof"


def row_logits(vocab: int, scale: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=g) * scale


TIES = torch.tensor([3.0, 1.0, 1.0, 1.0, 0.0, -1.0, -2.0, 1.0])
CASES = {
    "temperature": (dict(temperature=0.7), None),
    "hot": (dict(temperature=1.8), None),
    "top_k": (dict(top_k=5), None),
    "top_p": (dict(top_p=0.8), None),
    "min_p": (dict(min_p=0.1), None),
    "top_k+top_p+temperature": (dict(top_k=10, top_p=0.9, temperature=0.8), None),
    "top_k+min_p": (dict(top_k=20, min_p=0.05), None),
    "top_p+min_p": (dict(top_p=0.9, min_p=0.02, temperature=1.3), None),
    "penalties": (
        dict(
            penalties=(1.5, 0.4, 0.3),
            seen=[([3, 7, 11, 20, 40], [0, 2, 1, 0, 3])],
            banned=[[7, 0]],
        ),
        None,
    ),
    "penalties+top_k": (
        dict(top_k=8, penalties=(1.3, 0.2, 0.5), seen=[([1, 2, 5], [1, 0, 4])]),
        None,
    ),
    "ties at top_k": (dict(top_k=2), TIES),
    "ties at top_p": (dict(top_p=0.75), TIES),
    "ties at top_p with top_k": (dict(top_p=0.75, top_k=3), TIES),
}


@pytest.mark.parametrize("sampler", SAMPLERS)
@pytest.mark.parametrize("case", list(CASES))
def test_distribution_matches_the_reference(sampler, case):
    kw, row = CASES[case]
    if row is None:
        row = row_logits(64, 2.0, seed=len(case))
    n = 20_000
    md = make_md(n, **kw)
    logits = row.expand(n, -1).contiguous()
    one = make_md(1, **kw)
    probs = random_probs(masked_logits(row.unsqueeze(0), one), one)[0]
    assert_distribution(sampler(logits, md), probs)


def test_ties_are_kept_together_at_the_boundaries():
    # the reference itself: three tokens tied at the 2nd value are all in the top 2,
    # and the top-p boundary falling inside a tie keeps the whole tie
    one = make_md(1, top_k=2)
    assert int((random_probs(TIES.unsqueeze(0), one) > 0).sum()) == 5
    one = make_md(1, top_p=0.75)
    assert int((random_probs(TIES.unsqueeze(0), one) > 0).sum()) == 5


def test_tiny_temperatures_are_greedy():
    # 1 / 1e-40 overflows float32: such requests take the argmax, as in vLLM
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_tiny_top_p_and_top_k_1_are_greedy(sampler):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, 1000, generator=g)
    greedy = logits.argmax(dim=-1)
    assert torch.equal(sampler(logits, make_md(300, top_p=1e-6)), greedy)
    assert torch.equal(sampler(logits, make_md(300, top_k=1)), greedy)
    assert torch.equal(sampler(logits, make_md(300, greedy=True)), greedy)


def test_kernel_and_torch_draw_the_same_numbers():
    # a uniform distribution over 1024 tokens: the token is floor(u * 1024) in both,
    # so equal tokens mean the same Philox stream, key and counter layout
    for seed in (0, SEED, 2**64 - 1):
        md = make_md(2000, seed=seed)
        logits = torch.zeros(2000, 1024)
        assert torch.equal(kernel(logits, md), torch_path(logits, md))
    # and any distribution without top-k is walked in the same (index) order
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(500, 3000, generator=g) * 3
    for kw in (dict(), dict(top_p=0.9), dict(min_p=0.05, temperature=0.8)):
        md = make_md(500, **kw)
        same = (kernel(logits, md) == torch_path(logits, md)).float().mean()
        assert same > 0.99, kw  # rounding may move a draw sitting on a boundary


@pytest.mark.parametrize("sampler", SAMPLERS)
def test_seeded_rows_do_not_depend_on_the_batch(sampler):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(256, 5000, generator=g)
    md = make_md(256, top_p=0.9, top_k=100)
    md.params_i[1::2, I_TOP_K] = 0  # half the rows take the whole-row path
    md.params_f[::5, F_MIN_P] = 0.05
    md.params_i[:, I_SEED] = np.arange(256) % 5
    md.params_f[::3, F_TEMPERATURE] = 0.5
    md.params_i[::7, I_GREEDY] = 1
    batched = sampler(logits, md)
    for r in range(0, 256, 9):
        alone = SamplingMetadata(
            False, md.params_f[r : r + 1], md.params_i[r : r + 1], None, None, None
        )
        assert int(sampler(logits[r : r + 1], alone)[0]) == int(batched[r])
    md.params_i[:, I_SEED] += 1000
    assert not torch.equal(sampler(logits, md), batched)


def test_logprobs_are_log_softmax_of_the_raw_logits():
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(16, 5000, generator=g) * 4
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie at the top
    md = make_md(16, num_logprobs=5, top_k=50, penalties=(2.0, 0.5, 0.0), seen=[([10, 11], [1, 0])])
    md.params_i[5:, I_NUM_LOGPROBS] = 2  # fewer on some rows: the rest is padding
    out = sample_cpu(logits, md)
    lsm = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprob_ids is not None and out.logprob_values is not None
    assert out.logprob_ranks is not None
    ids, values = out.logprob_ids, out.logprob_values.double()
    assert torch.equal(ids[:, 0], out.sampled)
    assert torch.allclose(values[:, 0], lsm.gather(1, out.sampled.unsqueeze(1))[:, 0], atol=1e-5)
    sampled_logit = logits.gather(1, out.sampled.unsqueeze(1))
    assert torch.equal(out.logprob_ranks, (logits > sampled_logit).sum(dim=-1) + 1)
    top_vals, top_ids = logits.topk(5, dim=-1)
    for r in range(16):
        k = 5 if r < 5 else 2
        want = lsm[r].gather(0, top_ids[r, :k])
        assert torch.allclose(values[r, 1 : 1 + k], want, atol=1e-5)
        assert torch.equal(logits[r, ids[r, 1 : 1 + k]], top_vals[r, :k])
    assert sorted(ids[3, 1:3].tolist()) == [10, 20]  # tied: lower id first
    assert ids[3, 1] == 10


@pytest.mark.parametrize("path", [sample_cpu, sample_torch], ids=["kernel", "torch"])
def test_nonfinite_rows_do_not_fail_the_step(path):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(5, 100, generator=g)
    logits[0, 7] = float("nan")  # NaN ignored: a normal row
    logits[1, :] = float("nan")
    logits[2, [4, 9]] = float("inf")
    logits[3, :] = float("-inf")
    md = make_md(5, top_p=0.9, num_logprobs=2)
    out = path(logits, md)
    assert out.nonfinite_rows() == [1, 2, 3]
    assert out.sampled[1:4].tolist() == [0, 4, 0]
    assert out.sampled[0] != 7
    assert out.logprob_values is not None
    assert torch.isnan(out.logprob_values[2, 0])  # log_softmax of a row with +inf
    # rows 0 and 4 are unaffected by the others
    alone = make_md(5, top_p=0.9)
    rest = SamplingMetadata(False, alone.params_f[4:], alone.params_i[4:], None, None, None)
    assert path(logits[4:], rest).sampled[0] == out.sampled[4]
    # a greedy row never picks NaN either
    greedy = path(logits[:1], make_md(1, greedy=True)).sampled
    assert greedy[0] == torch.nan_to_num(logits[0], nan=-1e9).argmax()


def test_bad_arguments_raise_value_errors():
    logits = torch.zeros(3, 10)
    md = make_md(3, temperature=0.0)
    with pytest.raises(ValueError, match="row 0: temperature"):
        sample_cpu(logits, md)
    md = make_md(3, banned=[[12]])
    with pytest.raises(ValueError, match="banned token 12 is not in 0..10"):
        sample_cpu(logits, md)
    md = make_md(3)
    md.params_i[1, I_TOP_K] = -2
    with pytest.raises(ValueError, match="row 1: top_k"):
        sample_cpu(logits, md)
    md = make_md(3)
    md.params_f[2, F_TOP_P] = 0.0
    with pytest.raises(ValueError, match="row 2: top_p"):
        sample_cpu(logits, md)
    md = make_md(3)
    md.params_f[0, F_MIN_P] = float("nan")
    with pytest.raises(ValueError, match="min_p"):
        sample_cpu(logits, md)


# --- through the engine -----------------------------------------------------------


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def prompts(n: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(
            3, 1000, (int(torch.randint(4, 20, (1,), generator=g)),), generator=g
        ).tolist()
        for _ in range(n)
    ]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.usefixtures("scheduling_mode")
def test_seeded_requests_through_the_engine(llama_dir):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=77, max_tokens=24, ignore_eos=True)
    other = SamplingParams(temperature=0.9, top_k=50, max_tokens=30, ignore_eos=True)
    ps = prompts(256)
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32", max_num_seqs=256)
    alone = tokens(llm.generate([ps[0]], seeded, use_tqdm=False))[0]
    in_batch = llm.generate(ps, [seeded] + [other] * 255, use_tqdm=False)
    assert tokens(in_batch)[0] == alone
    reseeded = seeded.clone(seed=78)
    assert tokens(llm.generate([ps[0]], reseeded, use_tqdm=False))[0] != alone
    # the torch path (CUDA's) draws the same numbers: same tokens for plain sampling
    plain = SamplingParams(temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    by_kernel = tokens(llm.generate(ps[:4], plain, use_tqdm=False))
    import asyncllm.worker.sampler as sampler_mod

    original = sampler_mod.sample_cpu
    sampler_mod.sample_cpu = sample_torch  # the CPU's calls go to the torch sampler
    try:
        by_torch = tokens(llm.generate(ps[:4], plain, use_tqdm=False))
    finally:
        sampler_mod.sample_cpu = original
    assert by_torch == by_kernel
    # a fresh engine (another run) and one that must preempt give the same tokens
    preempting = LLM(
        str(llama_dir),
        multiprocess=False,
        dtype="float32",
        num_kv_blocks=12,
        block_size=8,
        max_model_len=64,
    )
    again = preempting.generate(ps[:8], [seeded] + [other] * 7, use_tqdm=False)
    assert preempting.engine.core.scheduler.num_preemptions > 0
    assert tokens(again)[0] == alone
