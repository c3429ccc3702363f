"""Batched sampling: penalties, min-tokens masking, greedy, temperature, top-k,
top-p, min-p, per-request seeds, and logprobs of the raw model distribution.

Each stage runs only when some request in the batch asks for it, so an all-greedy
batch costs one argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NEG_INF = float("-inf")


@dataclass(slots=True)
class Penalties:
    repetition: torch.Tensor  # [n] float32, 1.0 = off
    frequency: torch.Tensor  # [n] float32
    presence: torch.Tensor  # [n] float32
    prompt_mask: torch.Tensor  # [n, vocab] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [n, vocab] float32: occurrences among the outputs


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling inputs for the rows of the logits, built by the runner."""

    all_greedy: bool
    greedy_mask: torch.Tensor | None  # [n] bool, None when all greedy
    temperature: torch.Tensor | None  # [n, 1] float32 (1.0 on greedy rows)
    top_k: torch.Tensor | None  # [n] int64, vocab size = off
    top_p: torch.Tensor | None  # [n] float32
    min_p: torch.Tensor | None  # [n] float32
    generators: dict[int, torch.Generator]  # row -> the request's own generator
    penalties: Penalties | None
    # rows that may not stop yet, and the token ids they may not sample
    min_tokens_rows: list[tuple[int, list[int]]]
    max_num_logprobs: int | None


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [n] int64
    # logprobs of the raw model distribution: ids/values [n, 1 + N] (sampled first), ranks [n]
    logprob_ids: torch.Tensor | None = None
    logprob_values: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None


class Sampler:
    def __init__(self, generator: torch.Generator) -> None:
        self.generator = generator  # for requests without a seed

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        logits = raw = logits.float()  # `raw` stays unmodified: stages below copy
        if md.min_tokens_rows or md.penalties is not None:
            logits = logits.clone()
            for row, ids in md.min_tokens_rows:
                logits[row, ids] = _NEG_INF
            if md.penalties is not None:
                apply_penalties(logits, md.penalties)
        sampled = logits.argmax(dim=-1)
        if not md.all_greedy:
            random = self._sample_random(logits, md)
            assert md.greedy_mask is not None
            sampled = torch.where(md.greedy_mask, sampled, random)
        out = SamplerOutput(sampled=sampled)
        if md.max_num_logprobs is not None:
            _gather_logprobs(out, raw, sampled, md.max_num_logprobs)
        return out

    def _sample_random(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        assert md.temperature is not None
        logits = logits / md.temperature
        if md.top_k is not None or md.top_p is not None:
            logits = apply_top_k_top_p(logits, md.top_k, md.top_p)
        probs = torch.softmax(logits, dim=-1)
        if md.min_p is not None:
            max_p = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < md.min_p.unsqueeze(1) * max_p, 0.0)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Seeded rows
        # draw their noise from their own generator, so their tokens do not depend
        # on what else is in the batch.
        noise = torch.empty_like(probs)
        if len(md.generators) < probs.shape[0]:
            noise.exponential_(generator=self.generator)
        for row, gen in md.generators.items():
            noise[row].exponential_(generator=gen)
        return (probs / noise).argmax(dim=-1)


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


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p sets with -inf."""
    if top_p is None:
        assert top_k is not None
        # Only top-k: a partial selection is much cheaper than a full sort.
        vocab = logits.shape[-1]
        enabled = top_k < vocab
        max_k = int(top_k[enabled].max()) if bool(enabled.any()) else vocab
        top_vals = logits.topk(max_k, dim=-1).values
        kth = top_vals.gather(1, (top_k.clamp(max=max_k) - 1).unsqueeze(1))
        kth = kth.masked_fill(~enabled.unsqueeze(1), _NEG_INF)
        return logits.masked_fill(logits < kth, _NEG_INF)
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(1, (vocab - top_k).clamp(min=0).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # always keep the most likely token
    sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(
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
