"""One step's model inputs, gathered from the persistent `InputBatch`.

Requests are laid out in attention order: the 1-token queries (decodes) first,
then the prompt chunks, each in the scheduler's order. Everything here is
vectorised numpy over the batch's rows; the only per-request Python work is
reading the scheduler's dict of scheduled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.models.attention import AttentionMetadata, build_attention_metadata
from asyncllm.worker.input_batch import InputBatch


@dataclass(slots=True)
class StepInputs:
    """Per request (entry i of each array is `req_ids[i]`) and per token."""

    req_ids: list[int]
    rows: np.ndarray  # [n] int64: each request's row of the input batch
    query_lens: np.ndarray  # [n] int32: tokens this step
    context_lens: np.ndarray  # [n]: tokens already in the KV cache
    seq_lens: np.ndarray  # [n]: context + query
    cu_query_lens: np.ndarray  # [n]: cumulative query lengths (a request's last token is cu - 1)
    num_tokens: int  # T, the step's tokens
    token_rows: np.ndarray  # [T] int64: each token's row
    positions: np.ndarray  # [T] int64
    input_ids: np.ndarray  # [T]
    slots: np.ndarray  # [T] int64: KV cache slot of each token
    block_tables: np.ndarray  # [n, blocks the longest request reads]
    sampled: np.ndarray  # [n] bool: all known tokens computed after this step, so it samples
    attention: AttentionMetadata

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)


def gather_step_inputs(
    ib: InputBatch,
    so: SchedulerOutput,
    block_size: int,
    device: torch.device,
    pass_prompt_lens: bool,
    token_wise: bool = False,
    prompt_runs: bool = False,
) -> StepInputs:
    """The inputs of a non-empty step whose requests `ib` already holds.
    `token_wise` (batch-invariant mode): every prompt token attends as a decode of
    its own, through the decode kernel, so its result is the same whatever chunk
    or batch it comes in (`AttentionMetadata.token_wise`). `prompt_runs` (the CPU):
    the same where the per-token block tables stay small (`MAX_TOKEN_TABLE`): the
    kernel takes a prompt's tokens as runs that share each K/V read, one call a
    layer for every prompt of the step where SDPA ran one call a prompt (SmolLM2
    GGUF, Zen 5: ~6 % off a 106- or 594-token prefill). Requests that verify
    drafts (`so.spec_token_ids`, already written after their known tokens) come
    after the decodes and attend token-wise too; they sample after their drafts."""
    req_ids = list(so.num_scheduled_tokens)
    n = len(req_ids)
    q = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int32, count=n)
    rows = np.fromiter((ib.rows[r] for r in req_ids), dtype=np.int64, count=n)
    spec = so.spec_token_ids
    nd = _num_drafts(req_ids, spec) if spec else None
    if not (q == 1).all():
        # attention takes the 1-token queries (decodes) first, then verifications
        key = q != 1 if nd is None else (q != 1).astype(np.int8) * (1 + (nd == 0))
        order = np.argsort(key, kind="stable")
        q, rows = q[order], rows[order]
        req_ids = [req_ids[i] for i in order]
        nd = None if nd is None else nd[order]
    ctx = ib.num_computed[rows]
    seq_lens = ctx + q
    cu = np.cumsum(q)
    total = int(cu[-1])
    bs = block_size
    if total == n:  # decode-only step: one token per request
        tok_rows, pos = rows, ctx.astype(np.int64)
    else:
        tok_rows = np.repeat(rows, q)
        pos = np.arange(total, dtype=np.int64) + np.repeat(ctx - (cu - q), q)
    slots = ib.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
    max_nb = int((seq_lens.max() + bs - 1) // bs)
    tables = ib.block_table[rows, :max_nb]
    prompt_lens = ib.num_prompt_tokens[rows] if pass_prompt_lens else None
    meta = build_attention_metadata(q, ctx, tables, slots, bs, device, prompt_lens)
    _set_token_wise_spans(meta, tables, q, pos, nd, token_wise, prompt_runs, device)
    known = ib.num_tokens[rows] if nd is None else ib.num_tokens[rows] + nd
    return StepInputs(
        req_ids=req_ids,
        rows=rows,
        query_lens=q,
        context_lens=ctx,
        seq_lens=seq_lens,
        cu_query_lens=cu,
        num_tokens=total,
        token_rows=tok_rows,
        positions=pos,
        input_ids=ib.token_ids[tok_rows, pos],
        slots=slots,
        block_tables=tables,
        sampled=seq_lens == known,
        attention=meta,
    )


# The most block-table entries (tokens x blocks of the longest request) a step's
# prompts attend token-wise with when only `prompt_runs` asks (2 MiB of int64).
MAX_TOKEN_TABLE = 1 << 18


def _set_token_wise_spans(
    meta: AttentionMetadata,
    tables: np.ndarray,
    q: np.ndarray,
    pos: np.ndarray,
    nd: np.ndarray | None,
    token_wise: bool,
    prompt_runs: bool,
    device: torch.device,
) -> None:
    """Which of the step's spans (after its decodes) attend token-wise: all of them
    in batch-invariant mode (`token_wise`); the verifications of drafts (`nd`), and
    the prompts beside them where `prompt_runs` takes prompts; with `prompt_runs`
    alone, the prompts (see `gather_step_inputs`)."""
    n, total = len(q), int(pos.shape[0])
    if nd is None and (total == n or not (token_wise or prompt_runs)):
        return  # decodes only, or nothing that attends token-wise: every step's case
    dec = int(np.count_nonzero(q == 1))  # decodes come first, one token each
    small = total * tables.shape[1] <= MAX_TOKEN_TABLE
    if token_wise and total > n:
        _set_token_wise(meta, tables, q, pos, dec, total, device)
    elif nd is not None:
        num_spec = int(np.count_nonzero(nd))
        if num_spec < n - dec and prompt_runs and small:
            # prompts beside the verifications: every span token-wise, as
            # `prompt_runs` has them without drafts, so the step stays one
            # fused call where the model has one (a step that mixed both had
            # taken the torch path whole)
            _set_token_wise(meta, tables, q, pos, dec, total, device)
        else:
            end = dec + int(q[dec : dec + num_spec].sum())
            _set_token_wise(meta, tables, q, pos, dec, end, device)
            meta.token_wise_spans = num_spec
    elif prompt_runs and total > n and small:
        _set_token_wise(meta, tables, q, pos, dec, total, device)


def _num_drafts(req_ids: list[int], spec: dict[int, list[int]]) -> np.ndarray:
    """Each request's number of drafts to verify this step (0: none)."""
    return np.fromiter((len(spec.get(r, ())) for r in req_ids), dtype=np.int32, count=len(req_ids))


def _set_token_wise(
    meta: AttentionMetadata,
    tables: np.ndarray,
    q: np.ndarray,
    pos: np.ndarray,
    start: int,
    end: int,
    device: torch.device,
) -> None:
    """Tokens `start:end` of the step (after the decodes) attend as decodes of
    their own: per token its request's block table and its seq_len."""
    seq_of_token = np.repeat(np.arange(len(q)), q)[start:end]
    token_tables = np.ascontiguousarray(tables[seq_of_token], dtype=np.int64)
    meta.token_wise = (
        torch.from_numpy(token_tables).to(device),
        torch.from_numpy(pos[start:end] + 1).to(device),
    )
