"""A step's sampling inputs, gathered from the persistent rows of `InputBatch`:
one fancy index for the packed per-row parameters, plus sparse token lists for
the few rows with penalties, bans (`min_tokens`, bad words) or a logit bias
(worker/token_rules.py). Both samplers read it: the
CPU kernel (`sampler_kernel`) as is, the torch path (`sampler_torch`) after
densifying the token lists on the logits' device."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.worker.input_batch import I_NUM_LOGPROBS, I_POSITION, InputBatch
from asyncllm.worker.token_rules import BiasLists, RowTokenRules, step_token_rules


@dataclass(slots=True)
class TokenLists:
    """Per-row token lists in CSR form: row r's are tokens[offsets[r]:offsets[r+1]]."""

    offsets: np.ndarray  # [n + 1] int64
    tokens: np.ndarray  # int64
    counts: np.ndarray  # int64, parallel to tokens (seen lists: occurrences in the outputs)


@dataclass(slots=True)
class SamplingMetadata:
    """Per-step sampling inputs for the rows of the logits."""

    all_greedy: bool
    # [n, 6] float32 / int64 in the column layout of input_batch.F_* / I_*; the
    # sampler keys the streams of unseeded rows (I_STREAM != 0) by the engine's seed
    params_f: np.ndarray
    params_i: np.ndarray
    # tokens each penalised row has seen (each once; counts = occurrences among the
    # outputs, 0 = prompt only); None when no row has penalties
    seen: TokenLists | None
    # tokens each row may not sample now (min_tokens, bad words); None when none
    banned: TokenLists | None
    max_num_logprobs: int | None
    # output constraints: (indices of the constrained rows [m] int64, their
    # allowed-token bitmask [m, ceil(vocab / 32)] int32); None when no row has one
    allowed: tuple[np.ndarray, np.ndarray] | None = None
    # logit_bias of the rows that have one (added before the penalties)
    bias: BiasLists | None = None
    # rows with allowed_token_ids: the sampler ANDs their masks into `allowed`
    allowed_tokens: list[tuple[int, RowTokenRules]] | None = None

    @property
    def num_logprobs(self) -> np.ndarray:
        return self.params_i[:, I_NUM_LOGPROBS]


def build_sampling_metadata(
    ib: InputBatch,
    rows: np.ndarray,
    vocab_size: int,
    device: torch.device,
    offsets: np.ndarray | None = None,
) -> SamplingMetadata:
    """The inputs for sampling `rows`. `vocab_size` and `device` are not needed:
    the samplers take both from the logits (kept for the runner's call).
    `offsets` (speculative decoding): each row samples that many positions after
    its request's next one (a row may then appear more than once)."""
    params_f = ib.sample_f[rows]
    params_i = ib.sample_i[rows]
    num_out = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
    if offsets is not None:
        num_out = num_out + offsets
    params_i[:, I_POSITION] = num_out
    num_logprobs = params_i[:, I_NUM_LOGPROBS]
    max_num_logprobs = int(num_logprobs.max()) if (num_logprobs >= 0).any() else None
    md = SamplingMetadata(
        all_greedy=bool(ib.greedy[rows].all()),
        params_f=params_f,
        params_i=params_i,
        seen=_seen_tokens(ib, rows) if ib.has_penalty[rows].any() else None,
        banned=_banned_tokens(ib, rows, num_out),
        max_num_logprobs=max_num_logprobs,
    )
    if ib.num_token_rules:  # the one check a step without token rules pays
        _add_token_rules(md, ib, rows)
    return md


def _add_token_rules(md: SamplingMetadata, ib: InputBatch, rows: np.ndarray) -> None:
    """The rows' logit bias, allowed tokens and bad-word bans (after the tokens
    each row has generated so far)."""
    rules: list[RowTokenRules | None] = []
    outputs: list[list[int] | None] = []
    for row in rows.tolist():
        state = ib.states[row]
        r = None if state is None else state.rules
        rules.append(r)
        if r is None or not (r.bad_words or r.always_banned):
            outputs.append(None)
            continue
        longest = max((len(w) for w in r.bad_words), default=1)
        n_prompt, n_total = int(ib.num_prompt_tokens[row]), int(ib.num_tokens[row])
        outputs.append(ib.token_ids[row, max(n_prompt, n_total - longest + 1) : n_total].tolist())
    step = step_token_rules(rules, outputs)
    if step is None:
        return
    md.bias = step.bias
    md.allowed_tokens = step.allowed_rows or None
    if step.bans:
        md.banned = _with_bans(md.banned, step.bans, len(rules))


def _with_bans(banned: TokenLists | None, bans: dict[int, list[int]], n: int) -> TokenLists:
    """`banned` with each row's `bans` added."""
    lists: list[tuple[np.ndarray, np.ndarray] | None] = []
    for i in range(n):
        parts = []
        if banned is not None and banned.offsets[i + 1] > banned.offsets[i]:
            parts.append(banned.tokens[banned.offsets[i] : banned.offsets[i + 1]])
        if i in bans:
            parts.append(np.asarray(bans[i], dtype=np.int64))
        if not parts:
            lists.append(None)
            continue
        tokens = np.concatenate(parts)
        lists.append((tokens, np.zeros(len(tokens), dtype=np.int64)))
    return _csr(lists)


def _csr(lists: list[tuple[np.ndarray, np.ndarray] | None]) -> TokenLists:
    lens = [0 if x is None else len(x[0]) for x in lists]
    offsets = np.zeros(len(lists) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    parts = [x for x in lists if x is not None]
    if not parts:
        empty = np.zeros(0, dtype=np.int64)
        return TokenLists(offsets, empty, empty)
    tokens = np.concatenate([t for t, _ in parts]).astype(np.int64, copy=False)
    counts = np.concatenate([c for _, c in parts]).astype(np.int64, copy=False)
    return TokenLists(offsets, tokens, counts)


def _seen_tokens(ib: InputBatch, rows: np.ndarray) -> TokenLists:
    """Each penalised row's distinct prompt and output tokens with their output
    counts; the prompt's distinct tokens were found once, when the row was added."""
    lists: list[tuple[np.ndarray, np.ndarray] | None] = []
    for row in rows.tolist():
        state = ib.states[row]
        if not ib.has_penalty[row] or state is None or state.prompt_tokens is None:
            lists.append(None)
            continue
        n_prompt, n_total = int(ib.num_prompt_tokens[row]), int(ib.num_tokens[row])
        out_tokens, out_counts = np.unique(ib.token_ids[row, n_prompt:n_total], return_counts=True)
        tokens = np.union1d(state.prompt_tokens, out_tokens)
        counts = np.zeros(len(tokens), dtype=np.int64)
        counts[np.searchsorted(tokens, out_tokens)] = out_counts
        lists.append((tokens, counts))
    return _csr(lists)


def _banned_tokens(ib: InputBatch, rows: np.ndarray, num_out: np.ndarray) -> TokenLists | None:
    """The stop tokens of the rows that have not yet produced `min_tokens`."""
    blocked = np.flatnonzero(num_out < ib.min_tokens[rows])
    if len(blocked) == 0:
        return None
    lists: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(rows)
    for i in blocked.tolist():
        state = ib.states[rows[i]]
        if state is not None and state.stop_token_ids:
            ids = np.asarray(state.stop_token_ids, dtype=np.int64)
            lists[i] = (ids, np.zeros(len(ids), dtype=np.int64))
    return _csr(lists)


def let_grammar_win(md: SamplingMetadata) -> None:
    """`min_tokens` against a grammar that allows only tokens the row may not take
    yet (its output is complete: only EOS may follow) would leave the row nothing
    to sample. The grammar wins: that row's ban is lifted, it samples EOS, and the
    request finishes with "stop" (the core stops a constrained request on a stop
    token before `min_tokens`: only this lets one through). Both samplers call it;
    rows banned and constrained at once are few, so a loop over them is cheap."""
    if md.allowed is None or md.banned is None:
        return
    rows, bitmask = md.allowed
    banned = md.banned
    offsets = banned.offsets
    lifted: list[int] = []
    for i, r in enumerate(rows.tolist()):
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        if lo == hi:
            continue
        tokens = banned.tokens[lo:hi]
        bits = np.zeros(bitmask.shape[1], dtype=np.uint32)
        np.bitwise_or.at(bits, tokens // 32, np.left_shift(1, tokens % 32).astype(np.uint32))
        if not (bitmask[i].view(np.uint32) & ~bits).any():
            lifted.append(r)
    if not lifted:
        return
    keep = np.ones(len(offsets) - 1, dtype=bool)
    keep[lifted] = False
    lens = np.diff(offsets) * keep
    new_offsets = np.zeros_like(offsets)
    np.cumsum(lens, out=new_offsets[1:])
    entries = np.repeat(keep, np.diff(offsets))
    md.banned = TokenLists(new_offsets, banned.tokens[entries], banned.counts[entries])
