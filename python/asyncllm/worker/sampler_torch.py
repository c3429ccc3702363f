"""The torch sampler: dense and device-agnostic. It is the sampler on CUDA and the
reference the CPU kernel (rust/sampler) is tested against, with the same semantics:
logit bias, then penalties, and bans (`min_tokens`, bad words), greedy argmax,
temperature, top-k (ties at the k-th value kept), top-p (the largest tokens while
the mass before them is below top_p; ties at the boundary kept together), min-p
(after top-k and top-p, relative to the largest probability), then the draw by
inverse CDF with one uniform per row from Philox4x32-10 keyed by (seed, stream,
output position) — the same numbers as the kernel's, so a seeded request's tokens
depend on nothing else in the batch. Logprobs are of the raw logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.worker.input_batch import (
    F_FREQUENCY,
    F_MIN_P,
    F_PRESENCE,
    F_REPETITION,
    F_TEMPERATURE,
    F_TOP_P,
    I_GREEDY,
    I_POSITION,
    I_SEED,
    I_STREAM,
    I_TOP_K,
)
from asyncllm.worker.sampler_output import SamplerOutput
from asyncllm.worker.sampling_metadata import SamplingMetadata, TokenLists, let_grammar_win

_NEG_INF = float("-inf")


@dataclass(slots=True)
class Penalties:
    repetition: torch.Tensor  # [n] float32, 1.0 = off
    frequency: torch.Tensor  # [n] float32
    presence: torch.Tensor  # [n] float32
    prompt_mask: torch.Tensor  # [n, vocab] bool: token seen (prompt or outputs)
    output_counts: torch.Tensor  # [n, vocab] float32: occurrences among the outputs


def sample_torch(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Samples every row of `logits` [n, vocab] (any device) as `md` says."""
    raw = logits.float()
    if md.allowed is not None:
        let_grammar_win(md)
        raw = apply_token_bitmask(raw, *md.allowed)
    # NaN is never sampled, as in the kernel; masked unconditionally: asking
    # whether any is there would wait for the device before the draw is queued
    logits = masked_logits(raw, md).nan_to_num(nan=_NEG_INF, posinf=math.inf, neginf=_NEG_INF)
    sampled = logits.argmax(dim=-1)
    unsampled = None  # random rows without a finite maximum: they take the argmax
    if not md.all_greedy:
        random = draw(*random_distribution(logits, md), md)
        argmax_rows = torch.from_numpy(md.params_i[:, I_GREEDY] != 0).to(logits.device)
        no_max = ~logits.amax(dim=-1).isfinite()
        unsampled = no_max & ~argmax_rows
        sampled = torch.where(argmax_rows | no_max, sampled, random)
    # nothing here waits for the device: the runner reads `sampled` and
    # `nonfinite` when the host needs them (worker/in_flight.py)
    out = SamplerOutput(sampled=sampled, nonfinite=unsampled)
    if md.max_num_logprobs is not None:
        gather_logprobs(out, raw, sampled, md.max_num_logprobs)
    return out


def apply_token_bitmask(
    logits: torch.Tensor, rows: np.ndarray, bitmask: np.ndarray
) -> torch.Tensor:
    """A copy of `logits` with -inf at every token row `rows[i]` may not take:
    bit t % 32 of word t / 32 of `bitmask[i]` clear. One batched operation on the
    logits' device."""
    device = logits.device
    bits = torch.from_numpy(bitmask).to(device)
    shifts = torch.arange(32, device=device, dtype=torch.int32)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, : logits.shape[1]]
    r = torch.from_numpy(rows).to(device)
    out = logits.clone()
    out[r] = out[r].masked_fill(~allowed, _NEG_INF)
    return out


def masked_logits(raw: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """The logits after logit bias, bans (-inf) and penalties (a copy if any);
    penalties apply to the biased logits, as in the kernel."""
    if md.banned is None and md.seen is None and md.bias is None:
        return raw
    logits = raw.clone()
    if md.bias is not None:
        b, to = md.bias, raw.device
        bias_rows = np.repeat(np.arange(len(b.offsets) - 1), np.diff(b.offsets))
        values = torch.from_numpy(b.values).to(to)
        logits[torch.from_numpy(bias_rows).to(to), torch.from_numpy(b.tokens).to(to)] += values
    if md.banned is not None:
        rows, tokens, _ = _coo(md.banned, raw.device)
        logits[rows, tokens] = _NEG_INF
    if md.seen is not None:
        apply_penalties(logits, dense_penalties(md, raw.shape[1], raw.device))
    return logits


def _coo(lists: TokenLists, device: torch.device) -> tuple[torch.Tensor, ...]:
    rows = np.repeat(np.arange(len(lists.offsets) - 1), np.diff(lists.offsets))
    return tuple(torch.from_numpy(a).to(device) for a in (rows, lists.tokens, lists.counts))


def dense_penalties(md: SamplingMetadata, vocab: int, device: torch.device) -> Penalties:
    assert md.seen is not None
    n = md.params_f.shape[0]
    rows, tokens, counts = _coo(md.seen, device)
    seen = torch.zeros((n, vocab), dtype=torch.bool, device=device)
    seen[rows, tokens] = True
    output_counts = torch.zeros((n, vocab), dtype=torch.float32, device=device)
    output_counts[rows, tokens] = counts.float()
    f = torch.from_numpy(md.params_f).to(device)
    return Penalties(f[:, F_REPETITION], f[:, F_FREQUENCY], f[:, F_PRESENCE], seen, output_counts)


def apply_penalties(logits: torch.Tensor, p: Penalties) -> None:
    """In place. Repetition (prompt and outputs) divides positive logits and
    multiplies negative ones, as in the CTRL paper and transformers; frequency and
    presence (outputs only) subtract, as in OpenAI's API."""
    seen = p.prompt_mask | (p.output_counts > 0)
    rep = p.repetition.unsqueeze(1).expand_as(logits)
    scaled = torch.where(logits > 0, logits / rep, logits * rep)
    logits.copy_(torch.where(seen, scaled, logits))
    logits -= p.frequency.unsqueeze(1) * p.output_counts
    logits -= p.presence.unsqueeze(1) * (p.output_counts > 0).to(logits.dtype)


ROUNDS = 4  # rejection rounds before the kept set is drawn from directly (the kernel's)


def draw(probs: torch.Tensor, kept: torch.Tensor | None, md: SamplingMetadata) -> torch.Tensor:
    """Each row's token: rejection rounds over `probs` (after temperature and top-k)
    until `kept` (top-p and min-p) keeps the token, as rust/sampler does."""
    device = probs.device
    u = philox_uniform(md, device)
    token = inverse_cdf(probs, u)
    if kept is None:
        return token
    done = kept.gather(1, token.unsqueeze(1)).squeeze(1)
    # every round runs, whether or not a row still needs it: asking would wait for
    # the device, and the runner must not (worker/in_flight.py)
    for r in range(1, ROUNDS + 1):
        u = philox_uniform(md, device, r)
        t = inverse_cdf(probs if r < ROUNDS else probs * kept, u)
        ok = kept.gather(1, t.unsqueeze(1)).squeeze(1) | (r == ROUNDS)
        token = torch.where(done, token, t)
        done = done | ok
    return token


def random_distribution(
    logits: torch.Tensor, md: SamplingMetadata
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Each row's distribution after temperature and top-k, and the tokens top-p
    and min-p keep of it (None: all)."""
    device = logits.device
    f = torch.from_numpy(md.params_f).to(device)
    logits = logits / f[:, F_TEMPERATURE : F_TEMPERATURE + 1]
    vocab = logits.shape[-1]
    k = md.params_i[:, I_TOP_K]
    on = (k > 0) & (k < vocab)
    if on.any():
        k = np.where(on, k, vocab)
        logits = top_k_masked(logits, torch.from_numpy(k).to(device), int(k[on].max()))
    probs = torch.softmax(logits, dim=-1)
    kept = None
    if (md.params_f[:, F_TOP_P] < 1.0).any():
        kept = logits >= top_p_cut(logits, f[:, F_TOP_P])
    if (md.params_f[:, F_MIN_P] > 0).any():
        max_p = probs.amax(dim=-1, keepdim=True)
        by_min_p = probs >= f[:, F_MIN_P : F_MIN_P + 1] * max_p
        kept = by_min_p if kept is None else kept & by_min_p
    return probs, kept


def random_probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
    """Each row's sampling distribution after temperature, top-k, top-p and min-p
    (the tests' reference; zeros where a token cannot be drawn)."""
    probs, kept = random_distribution(logits, md)
    if kept is not None:
        probs = probs * kept
    return probs / probs.sum(dim=-1, keepdim=True)


def top_k_masked(logits: torch.Tensor, top_k: torch.Tensor, max_k: int) -> torch.Tensor:
    """`logits` with -inf below each row's k-th largest (`top_k` = vocab: off; the
    largest k below vocab is `max_k`, known on the host so that nothing here waits
    for the device); ties at the k-th value are kept. A partial selection, not a
    sort."""
    enabled = top_k < logits.shape[-1]
    top_vals = logits.topk(max_k, dim=-1).values
    kth = top_vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill(~enabled.unsqueeze(1), _NEG_INF)
    return logits.masked_fill(logits < kth, _NEG_INF)


def top_p_cut(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[n, 1]: the smallest logit top-p keeps — the largest tokens while the mass
    before them is below top_p; tokens tied at the boundary are kept together."""
    sorted_logits, _ = logits.sort(dim=-1, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    # `drop` is a prefix: the first kept value is the cut
    return sorted_logits.gather(1, drop.sum(dim=-1, keepdim=True))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The token where each row's cumulative probability (index order) first
    exceeds u × its total."""
    cdf = probs.double().cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return idx.clamp(max=probs.shape[-1] - 1)


_MASK = 0xFFFFFFFF


def _mulhilo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a × b for a constant a < 2^32 and int64 b < 2^32,
    without int64 overflow (16-bit halves of a)."""
    p1 = (a & 0xFFFF) * b  # < 2^48
    p2 = (a >> 16) * b  # < 2^48
    lo_sum = (p1 & _MASK) + ((p2 & 0xFFFF) << 16)
    hi = (p1 >> 32) + (p2 >> 16) + (lo_sum >> 32)
    return hi & _MASK, lo_sum & _MASK


def philox4x32_10(ctr: list[torch.Tensor], key: list[torch.Tensor]) -> list[torch.Tensor]:
    """Philox4x32-10 on int64 tensors holding 32-bit words (rust/sampler/philox.rs)."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(10):
        if r > 0:
            k0 = (k0 + 0x9E3779B9) & _MASK
            k1 = (k1 + 0xBB67AE85) & _MASK
        hi0, lo0 = _mulhilo(0xD2511F53, c0)
        hi1, lo1 = _mulhilo(0xCD9E8D57, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def philox_uniform(md: SamplingMetadata, device: torch.device, round: int = 0) -> torch.Tensor:
    """[n] float64 in [0, 1): each row's uniform of draw round `round`, as the
    kernel computes it (rust/sampler/philox.rs, `uniform_round`)."""
    i = torch.from_numpy(md.params_i).to(device)

    def words(x: torch.Tensor) -> list[torch.Tensor]:
        return [x & _MASK, (x >> 32) & _MASK]

    seed, stream, pos = i[:, I_SEED], i[:, I_STREAM], i[:, I_POSITION]
    pos = pos + ((round // 2) << 48)  # positions stay far below 2^48: no wrap
    x = philox4x32_10(words(pos) + words(stream), words(seed))
    hi, lo = (x[0], x[1]) if round % 2 == 0 else (x[2], x[3])
    bits = (hi << 21) | (lo >> 11)
    return bits.double() * 2.0**-53


def gather_logprobs(
    out: SamplerOutput, logits: torch.Tensor, sampled: torch.Tensor, num: int
) -> None:
    """Logprobs of the raw distribution as logit - logsumexp: no log-softmax copy of
    the [n, vocab] logits is made. Ranks and the top `num` compare logits, which
    order tokens as their logprobs do."""
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    sampled_logit = logits.gather(1, sampled.unsqueeze(1))
    out.logprob_ranks = (logits > sampled_logit).sum(dim=-1) + 1
    sampled_lp = sampled_logit - lse
    if num > 0:
        top_logit, top_ids = logits.topk(num, dim=-1)
        out.logprob_ids = torch.cat([sampled.unsqueeze(1), top_ids], dim=1)
        out.logprob_values = torch.cat([sampled_lp, top_logit - lse], dim=1)
    else:
        out.logprob_ids = sampled.unsqueeze(1)
        out.logprob_values = sampled_lp
