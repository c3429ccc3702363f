"""Prompt logprobs: the model's logprob of each prompt token given the ones
before it, gathered chunk by chunk and delivered once the prompt is complete.
The first prompt token has none (nothing predicts it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from asyncllm.messages import Logprobs

if TYPE_CHECKING:
    from asyncllm.worker.input_batch import InputBatch


class PromptLogprobsCollector:
    def __init__(self) -> None:
        # flat, row-major: one row of (1 + N) entries per prompt position
        self._partial: dict[int, tuple[list[int], list[float], list[int]]] = {}

    def drop(self, req_id: int) -> None:
        self._partial.pop(req_id, None)

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
            row = int(rows[i])
            n_prompt = int(ib.num_prompt_tokens[row])
            start, end = int(ctx[i]), min(int(ctx[i] + q[i]), n_prompt - 1)
            rid = req_ids[i]
            if rid not in self._partial:
                if start != 0:
                    continue  # resumed after preemption: already delivered
                self._partial[rid] = ([], [], [])
            ids, values, ranks = self._partial[rid]
            if end > start:
                flat = int(cu[i] - q[i])
                h = hidden[flat : flat + (end - start)]
                logprobs = torch.log_softmax(model.compute_logits(h).float(), dim=-1)
                targets = torch.from_numpy(
                    ib.token_ids[row, start + 1 : end + 1].astype(np.int64)
                ).to(logprobs.device)
                target_lp = logprobs.gather(1, targets.unsqueeze(1))
                k = int(ib.num_prompt_logprobs[row])
                top_lp, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
                rank = ((logprobs > target_lp).sum(dim=-1) + 1).tolist()
                t_ids = targets.tolist()
                t_lp = target_lp.squeeze(1).tolist()
                top_ids_l = top_ids.tolist() if top_ids is not None else [[]] * len(t_ids)
                top_lp_l = top_lp.tolist() if top_lp is not None else [[]] * len(t_ids)
                for j in range(len(t_ids)):
                    ids.append(t_ids[j])
                    ids.extend(top_ids_l[j])
                    values.append(t_lp[j])
                    values.extend(top_lp_l[j])
                    ranks.append(rank[j])
            if ctx[i] + q[i] >= n_prompt:
                del self._partial[rid]
                out[rid] = Logprobs(ids, values, ranks)
