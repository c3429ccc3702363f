"""Per-request token rules — OpenAI's `logit_bias`, vLLM's `allowed_token_ids`
and `bad_words` — in the forms both samplers already take: a bias list (added
to the logits before the penalties), an allowed-token bitmask (as a grammar's,
ANDed with one where a row has both) and banned tokens (-inf, as `min_tokens`'
bans). A row's rules are prepared once, when it is added; a step touches them
only when one of its rows has any (`InputBatch.num_token_rules`: one check).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from asyncllm.sampling_params import SamplingParams


@dataclass(slots=True)
class BiasLists:
    """Per-row logit biases in CSR form: row r's tokens are
    tokens[offsets[r]:offsets[r+1]] (sorted, distinct), `values` parallel."""

    offsets: np.ndarray  # [n + 1] int64
    tokens: np.ndarray  # int64
    values: np.ndarray  # float32


@dataclass(slots=True)
class RowTokenRules:
    """One request's rules, prepared when its row is added."""

    bias_tokens: np.ndarray  # int64, sorted; empty: no bias
    bias_values: np.ndarray  # float32, parallel
    allowed: np.ndarray | None  # int64 token ids; None: every token
    # one-token bad words (always banned) and the longer ones (their last token
    # is banned while the output ends with the rest)
    always_banned: list[int]
    bad_words: list[list[int]]
    # the allowed-token bitmask, made on first use for a width of `mask[1]` words
    mask: tuple[int, np.ndarray] | None = field(default=None)

    def allowed_mask(self, words: int) -> np.ndarray:
        """[words] int32: bit t % 32 of word t // 32 set for each allowed token."""
        if self.mask is None or self.mask[0] != words:
            assert self.allowed is not None
            ids = self.allowed[self.allowed < words * 32]
            bits = np.zeros(words, dtype=np.uint32)
            np.bitwise_or.at(bits, ids // 32, np.left_shift(1, ids % 32).astype(np.uint32))
            self.mask = (words, bits.view(np.int32))
        return self.mask[1]

    def bans(self, output: list[int]) -> list[int]:
        """The tokens banned after `output` (the request's tokens so far)."""
        banned = list(self.always_banned)
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix <= len(output) and output[len(output) - prefix :] == word[:-1]:
                banned.append(word[-1])
        return banned


def row_token_rules(p: SamplingParams) -> RowTokenRules | None:
    """`p`'s rules in the samplers' forms; None when it has none."""
    if not p.has_token_rules:
        return None
    bias = sorted((p.logit_bias or {}).items())
    words = p.bad_words_token_ids or []
    allowed = p.allowed_token_ids
    return RowTokenRules(
        bias_tokens=np.array([t for t, _ in bias], dtype=np.int64),
        bias_values=np.array([b for _, b in bias], dtype=np.float32),
        allowed=None if not allowed else np.unique(np.asarray(allowed, dtype=np.int64)),
        always_banned=[w[0] for w in words if len(w) == 1],
        bad_words=[list(w) for w in words if len(w) > 1],
    )


@dataclass(slots=True)
class StepTokenRules:
    """A step's rules over its `n` sampled rows (indices into the logits)."""

    bias: BiasLists | None  # None: no row has a bias
    # rows with allowed tokens and their rules (the mask is made at sampling,
    # when the logits' width is known)
    allowed_rows: list[tuple[int, RowTokenRules]]
    bans: dict[int, list[int]]  # row -> tokens its bad words ban now


def step_token_rules(
    rules: list[RowTokenRules | None], outputs: list[list[int] | None]
) -> StepTokenRules | None:
    """The step's rules from each sampled row's rules (None: none) and, for the
    rows with bad words, its output tokens so far; None when nothing applies."""
    n = len(rules)
    bias_rows: list[int] = []
    allowed_rows: list[tuple[int, RowTokenRules]] = []
    bans: dict[int, list[int]] = {}
    for i, r in enumerate(rules):
        if r is None:
            continue
        if len(r.bias_tokens):
            bias_rows.append(i)
        if r.allowed is not None:
            allowed_rows.append((i, r))
        out = outputs[i]
        if out is not None:
            banned = r.bans(out)
            if banned:
                bans[i] = banned
    if not (bias_rows or allowed_rows or bans):
        return None
    bias = None
    if bias_rows:
        lens = np.zeros(n, dtype=np.int64)
        for i in bias_rows:
            lens[i] = len(rules[i].bias_tokens)  # type: ignore[union-attr]
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        picked = [rules[i] for i in bias_rows]
        bias = BiasLists(
            offsets,
            np.concatenate([r.bias_tokens for r in picked if r is not None]),
            np.concatenate([r.bias_values for r in picked if r is not None]),
        )
    return StepTokenRules(bias, allowed_rows, bans)


def merge_allowed(
    grammar: tuple[np.ndarray, np.ndarray] | None,
    rows: list[tuple[int, RowTokenRules]],
    vocab: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The step's allowed-token masks: the grammar's rows (`grammar`: row indices
    and their [m, words] int32 bitmask), ANDed with `allowed_token_ids` where a
    row has both, plus the rows with only `allowed_token_ids`. A new array: the
    grammar's own is not written."""
    words = (vocab + 31) // 32
    if grammar is not None:
        words = max(words, grammar[1].shape[1])
    g_rows = [] if grammar is None else grammar[0].tolist()
    of_row = {r: i for i, r in enumerate(g_rows)}
    extra = [r for r, _ in rows if r not in of_row]
    out = np.zeros((len(g_rows) + len(extra), words), dtype=np.int32)
    if grammar is not None:
        out[: len(g_rows), : grammar[1].shape[1]] = grammar[1]
    for r in extra:
        of_row[r] = len(of_row)
    for r, rule in rows:
        i = of_row[r]
        mask = rule.allowed_mask(words)
        out[i] = mask if i >= len(g_rows) else out[i] & mask
    return np.array(g_rows + extra, dtype=np.int64), out
