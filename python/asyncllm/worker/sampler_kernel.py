"""The CPU sampler: the step's rows handed to the Rust kernel (`_core._sample`,
rust/sampler) in one call, with the GIL released, on torch's threads. The inputs
are the metadata's packed arrays as they are; only the outputs are allocated."""

from __future__ import annotations

import numpy as np
import torch

from asyncllm import _core
from asyncllm.worker.sampler_output import SamplerOutput
from asyncllm.worker.sampling_metadata import SamplingMetadata, TokenLists, let_grammar_win

_NO_TOKENS = TokenLists(
    np.zeros(1, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
)


def _lists(lists: TokenLists | None, n: int) -> TokenLists:
    if lists is not None:
        return lists
    return TokenLists(np.zeros(n + 1, dtype=np.int64), _NO_TOKENS.tokens, _NO_TOKENS.counts)


def sample_cpu(logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
    """Samples every row of the CPU `logits` [n, vocab]; `nonfinite` lists the rows
    whose logits had no finite maximum (sampled as their argmax)."""
    logits = logits.float().contiguous()
    n = logits.shape[0]
    mask_rows = bitmask = None
    if md.allowed is not None:  # tokens outside a row's grammar: -inf as the kernel reads
        let_grammar_win(md)
        mask_rows, bitmask = md.allowed
    width = 0 if md.max_num_logprobs is None else md.max_num_logprobs + 1
    sampled = torch.empty(n, dtype=torch.int64)
    ranks = torch.empty(n, dtype=torch.int64)
    ids = torch.empty((n, width), dtype=torch.int64)
    values = torch.empty((n, width), dtype=torch.float32)
    seen = _lists(md.seen, n)
    bias = md.bias
    banned = _lists(md.banned, n)
    # The kernel reads `logits` in place with the GIL released: sound because this
    # is the runner's thread and the tensor was just computed for this step; no
    # other thread holds it. The outputs are fresh tensors. The bitmask is the
    # grammar rows' own array, filled before this step's sampling and written
    # again only by the next step's fill.
    nonfinite = _core._sample(
        logits.numpy(),
        md.params_f,
        md.params_i,
        seen.offsets,
        seen.tokens,
        seen.counts,
        banned.offsets,
        banned.tokens,
        sampled.numpy(),
        ranks.numpy(),
        ids.numpy(),
        values.numpy(),
        torch.get_num_threads(),
        bitmask,
        mask_rows,
        *((None, None, None) if bias is None else (bias.offsets, bias.tokens, bias.values)),
    )
    out = SamplerOutput(sampled=sampled)
    if nonfinite:
        out.nonfinite = torch.zeros(n, dtype=torch.bool)
        out.nonfinite[nonfinite] = True
    if width:
        out.logprob_ids, out.logprob_values, out.logprob_ranks = ids, values, ranks
    return out
