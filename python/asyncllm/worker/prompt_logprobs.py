"""Prompt logprobs: the model's logprob of each prompt token given the ones
before it, gathered chunk by chunk and delivered once the prompt is complete.
The first prompt token has none (nothing predicts it).

A chunk's logits are computed a slice of rows at a time (`logit_slice_rows`), so
a long chunk over a large vocabulary costs a bounded amount of memory, not
chunk × vocabulary floats. A request preempted part-way through its prompt keeps
the rows it has; when it is recomputed from the start, rows already collected
are skipped, never appended twice.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncllm.messages import Logprobs

if TYPE_CHECKING:
    from asyncllm.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

# The most logits (rows × vocabulary) materialised at once when scoring prompt
# tokens: 4 Mi float32 = 16 MiB, plus a few temporaries of the same size.
MAX_LOGIT_ELEMENTS = 1 << 22


def logit_slice_rows(vocab_size: int, max_elements: int) -> int:
    """Rows of logits computed together: at least one, at most `max_elements` floats."""
    return max(1, max_elements // max(vocab_size, 1))


class PromptLogprobsCollector:
    def __init__(self, vocab_size: int) -> None:
        self.slice_rows = logit_slice_rows(vocab_size, MAX_LOGIT_ELEMENTS)
        # flat, row-major: one row of (1 + N) entries per prompt position
        self._partial: dict[int, tuple[list[int], list[float], list[int]]] = {}
        # delivered already: a request preempted during its decode recomputes its
        # prompt, and must not deliver it again
        self._delivered: set[int] = set()

    def drop(self, req_id: int) -> None:
        """Forget a finished request."""
        self._partial.pop(req_id, None)
        self._delivered.discard(req_id)

    def collect(
        self,
        model: Any,
        hidden: torch.Tensor,
        ib: InputBatch,
        rows: np.ndarray,
        req_ids: list[int],
        ctx: np.ndarray,
        q: np.ndarray,
        cu: np.ndarray,
        wanted: np.ndarray,
        out: dict[int, Logprobs],
    ) -> None:
        for i in np.flatnonzero(wanted).tolist():
            rid = req_ids[i]
            if rid in self._delivered:
                continue
            row = int(rows[i])
            n_prompt = int(ib.num_prompt_tokens[row])
            start, stop = int(ctx[i]), int(ctx[i] + q[i])
            partial = self._partial.setdefault(rid, ([], [], []))
            ids, values, ranks = partial
            first = len(ranks)  # positions before it were scored before a preemption
            if start > first:
                # Positions [first, start) came from the prefix cache, which requests
                # with prompt logprobs bypass: nothing can score them now.
                logger.error(
                    "request %d: prompt logprobs skipped positions %d..%d", rid, first, start
                )
                del self._partial[rid]
                self._delivered.add(rid)
                continue
            end = min(stop, n_prompt - 1)
            if end > first:
                flat = int(cu[i] - q[i]) + first - start
                targets = ib.token_ids[row, first + 1 : end + 1]
                k = int(ib.num_prompt_logprobs[row])
                self._score(model, hidden[flat : flat + end - first], targets, k, partial)
            if stop >= n_prompt:
                del self._partial[rid]
                self._delivered.add(rid)
                out[rid] = Logprobs(ids, values, ranks)

    def _score(
        self,
        model: Any,
        hidden: torch.Tensor,
        targets: np.ndarray,
        k: int,
        into: tuple[list[int], list[float], list[int]],
    ) -> None:
        """Append, for each row of `hidden`, the logprob and rank of its target token
        and the top `k`, a slice of rows at a time. logprob = logit - logsumexp, so
        no log-softmax copy of the logits is made; ranks and the top k compare
        logits, which order tokens as their logprobs do."""
        ids, values, ranks = into
        all_targets = torch.from_numpy(targets.astype(np.int64))
        for s in range(0, len(targets), self.slice_rows):
            logits = model.compute_logits(hidden[s : s + self.slice_rows]).float()
            t = all_targets[s : s + self.slice_rows].to(logits.device).unsqueeze(1)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            t_logit = logits.gather(1, t)
            rank = ((logits > t_logit).sum(dim=-1) + 1).tolist()
            t_lp = (t_logit - lse).squeeze(1).tolist()
            t_ids = t.squeeze(1).tolist()
            if k > 0:
                top_logit, top_ids = logits.topk(k, dim=-1)
                top_ids_l = top_ids.tolist()
                top_lp_l = (top_logit - lse).tolist()
            del logits
            for j in range(len(t_ids)):
                ids.append(t_ids[j])
                values.append(t_lp[j])
                ranks.append(rank[j])
                if k > 0:
                    ids.extend(top_ids_l[j])
                    values.extend(top_lp_l[j])
