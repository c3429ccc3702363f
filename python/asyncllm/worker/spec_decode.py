"""Speculative decoding in the runner: proposals, and verification by the draw.

Proposals: after each step, one call of the Rust proposer (`_core.NgramProposer`,
rust/spec/ngram.rs, or `_core.SuffixProposer`, rust/spec/suffix.rs) appends every
sampled row's new tokens to that row's index and proposes its next drafts, with
the GIL released; or the draft model (worker/draft_model.py) runs k forwards for
every sampled row at once.
The scheduler budgets them and sends them back in the next step's plan
(`SchedulerOutput.spec_token_ids`).

Verification: a request with d drafts brings 1 + d query tokens (its last token,
then the drafts), which attend as decodes of their own on the Rust decode kernel
(`AttentionMetadata.token_wise`). Its logits at all 1 + d positions go to the
sampler in the same call as every other row, position j drawn with the output
position of that token: the sampler's draw depends only on (seed, position,
logits), so the token drawn at position j is the token decoding without
speculation would draw there, given the same prefix. Drafts are accepted while
they equal those draws, and the first draw that differs (or the one after the
last draft) is kept too. The output is therefore the output without speculation:
token for token for greedy and seeded requests (up to floating-point differences
between a k+1-token forward and a 1-token one), in distribution for unseeded
ones. For a draft that is a single proposed token (n-gram, suffix), this accepts
with probability p(draft), which is what rejection sampling accepts with.

Rows that depend on their own earlier outputs in ways the drafts would change
(penalties, logit rules such as bad words, grammars) and rows that want prompt
logprobs are not given drafts: they decode one token per step as before.
"""

from __future__ import annotations

import itertools

import numpy as np

from asyncllm import _core
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.messages import Logprobs
from asyncllm.spec_config import SpeculativeConfig
from asyncllm.worker.draft_budget import DraftBudget
from asyncllm.worker.draft_model import DraftModel
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.sampler_output import SamplerOutput


class Expansion:
    """A step's sampled requests laid out as logit rows: request i owns rows
    `start[i] : start[i] + 1 + num_drafts[i]`, row `start[i] + j` being its
    token `last_token[i] - num_drafts[i] + j` of the step, drawn at output
    position offset j."""

    __slots__ = ("num_drafts", "start", "token_index", "rows", "offsets")

    def __init__(self, num_drafts: np.ndarray, last_token: np.ndarray, rows: np.ndarray) -> None:
        self.num_drafts = num_drafts
        width = num_drafts + 1
        ends = np.cumsum(width)
        self.start = ends - width
        total = int(ends[-1]) if len(ends) else 0
        # offset of each logit row within its request's run
        self.offsets = np.arange(total, dtype=np.int64) - np.repeat(self.start, width)
        self.token_index = np.repeat(last_token - num_drafts, width) + self.offsets
        self.rows = np.repeat(rows, width)


def make_proposer(
    config: SpeculativeConfig, max_num_seqs: int
) -> _core.NgramProposer | _core.SuffixProposer:
    """The Rust proposer of the configured method, with a row per batch row."""
    if config.method == "suffix":
        return _core.SuffixProposer(
            max_num_seqs,
            config.suffix_decoding_max_tree_depth,
            config.suffix_decoding_max_cached_requests,
            config.suffix_decoding_max_cached_tokens,
            config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob,
        )
    return _core.NgramProposer(max_num_seqs, config.prompt_lookup_min, config.prompt_lookup_max)


class SpecDecoder:
    """The runner's proposer (n-gram, suffix or a draft model) and verifier."""

    def __init__(self, config: EngineConfig, num_blocks: int, vocab_size: int) -> None:
        spec = config.speculative
        assert spec is not None
        max_num_seqs = config.max_num_seqs
        self.k = spec.num_speculative_tokens
        self.draft: DraftModel | None = None
        self.proposer: _core.NgramProposer | _core.SuffixProposer | None = None
        if spec.method == "draft_model":
            assert spec.model is not None
            self.draft = DraftModel(config, spec.model, num_blocks, vocab_size)
        else:
            self.proposer = make_proposer(spec, max_num_seqs)
        self.eligible = np.zeros(max_num_seqs, dtype=bool)
        self.budget = DraftBudget(self.k, max_num_seqs) if spec.adaptive_drafts else None
        self._no_tokens = np.zeros(0, dtype=np.int32)

    def add(self, ib: InputBatch, row: int, new: NewRequestData) -> None:
        """A request joined at `row`: index its tokens if it may speculate."""
        state = ib.states[row]
        p = new.sampling_params
        ok = (
            new.grammar is None
            and not ib.has_penalty[row]
            and (state is None or state.rules is None)
            and p.prompt_logprobs is None
        )
        self.eligible[row] = ok
        if self.budget is not None:
            self.budget.reset(row)
        if not ok or self.proposer is None:
            return  # the draft model starts a row from nothing (`DraftModel.remove`)
        tokens = np.asarray(new.token_ids, dtype=np.int32)
        if isinstance(self.proposer, _core.SuffixProposer):
            self.proposer.add(row, new.req_id, tokens, new.num_prompt_tokens)
        else:
            self.proposer.add(row, tokens)

    def remove(self, row: int) -> None:
        if self.eligible[row]:
            self.eligible[row] = False
            if self.draft is not None:
                self.draft.remove(row)
            else:
                assert self.proposer is not None
                self.proposer.remove(row)

    def write_drafts(self, ib: InputBatch, spec: dict[int, list[int]]) -> None:
        """Put each request's drafts after its known tokens, where the step reads
        its input ids (`gather_step_inputs`)."""
        for rid, drafts in spec.items():
            row = ib.rows[rid]
            n = int(ib.num_tokens[row])
            ib.token_ids[row, n : n + len(drafts)] = drafts

    def verify(
        self, exp: Expansion, drawn: np.ndarray, ib: InputBatch, rows: np.ndarray
    ) -> tuple[np.ndarray, list[list[int]]]:
        """Each request's accepted draft count and tokens (its accepted drafts and
        the draw after them), from the draws at its logit rows."""
        num_accepted = np.zeros(len(rows), dtype=np.int64)
        tokens: list[list[int]] = []
        drawn_list = drawn.tolist()
        starts = exp.start.tolist()
        for i, d in enumerate(exp.num_drafts.tolist()):
            s = starts[i]
            if d == 0:
                tokens.append([drawn_list[s]])
                continue
            row = int(rows[i])
            n = int(ib.num_tokens[row])
            drafts = ib.token_ids[row, n : n + d].tolist()
            a = 0
            while a < d and drafts[a] == drawn_list[s + a]:
                a += 1
            num_accepted[i] = a
            tokens.append(drawn_list[s : s + a + 1])
        if self.budget is not None:
            self.budget.observe_verified(rows, exp.num_drafts, num_accepted)
        return num_accepted, tokens

    def observe_step(self, requests: int, rows: int, seconds: float) -> None:
        """A speculative engine's step of `requests` requests and `rows` tokens
        took `seconds`."""
        if self.budget is not None:
            self.budget.observe_step(requests, rows, seconds)

    def propose(
        self,
        ib: InputBatch,
        rows: np.ndarray,
        req_ids: list[int],
        tokens: list[list[int]],
        num_drafts: np.ndarray,
        num_accepted: np.ndarray,
        room: np.ndarray,
    ) -> dict[int, list[int]]:
        """Feed each sampled row's new tokens to the proposer and return the
        drafts of those that got any (at most `room` each: what the model's
        length leaves)."""
        keep = self.eligible[rows]
        if keep.all():  # the usual case: no fancy indexing
            idx, prows, new = None, rows, tokens
        elif keep.any():
            idx = np.flatnonzero(keep)
            prows = rows[idx]
            new = [tokens[i] for i in idx.tolist()]
            num_drafts, num_accepted, room = num_drafts[idx], num_accepted[idx], room[idx]
        else:
            return {}
        prows = np.ascontiguousarray(prows, dtype=np.int64)
        cap = self.k if self.budget is None else self.budget.caps(len(rows), prows)
        max_drafts = np.minimum(np.maximum(room, 0), cap).astype(np.int64, copy=False)
        if self.draft is not None:
            proposed = self.draft.propose(ib, prows, max_drafts)
            return {rid: d for rid, d in zip(_pick(req_ids, idx), proposed, strict=True) if d}
        assert self.proposer is not None
        offsets = np.fromiter(
            itertools.accumulate((len(t) for t in new), initial=0),
            dtype=np.int64,
            count=len(new) + 1,
        )
        total = int(offsets[-1])
        flat = np.fromiter(itertools.chain.from_iterable(new), dtype=np.int32, count=total)
        counts, drafts = self.proposer.step(
            prows,
            offsets,
            flat,
            num_drafts.astype(np.int64, copy=False),
            num_accepted.astype(np.int64, copy=False),
            max_drafts,
        )
        out: dict[int, list[int]] = {}
        pos = 0
        for rid, c in zip(_pick(req_ids, idx), counts, strict=True):
            if c:
                out[rid] = drafts[pos : pos + c]
                pos += c
        return out


def _pick(items: list[int], idx: np.ndarray | None) -> list[int]:
    """`items` at `idx`, or all of them where `idx` is None."""
    return items if idx is None else [items[i] for i in idx.tolist()]


def spec_logprobs(
    result: SamplerOutput,
    exp: Expansion,
    tokens: list[list[int]],
    wanted: list[int],
    req_ids: list[int],
) -> dict[int, Logprobs]:
    """Each request's logprobs (`wanted[i]` top entries after the sampled token, or
    none when -1) over the positions of its kept tokens."""
    assert result.logprob_ids is not None
    assert result.logprob_values is not None and result.logprob_ranks is not None
    ids, values = result.logprob_ids.tolist(), result.logprob_values.tolist()
    ranks = result.logprob_ranks.tolist()
    out = {}
    for i, rid in enumerate(req_ids):
        k = wanted[i]
        if k < 0:
            continue
        start = int(exp.start[i])
        end = start + len(tokens[i])
        flat_ids = [t for r in range(start, end) for t in ids[r][: k + 1]]
        flat_values = [v for r in range(start, end) for v in values[r][: k + 1]]
        out[rid] = Logprobs(flat_ids, flat_values, ranks[start:end])
    return out
