"""The runner's side of embedding requests: pool each one's final hidden states
(after the model's last norm) when its prompt is done.

An embedding request runs through the step like a prompt that never samples:
`split` takes its rows out of the step's sampled rows before the masks and the
sampler see them, and `pool` reads their tokens' hidden states after the
forward. Last-token pooling needs only the final chunk's last token; mean
pooling adds every chunk's tokens to a running float32 sum (a long prompt under
chunked prefill spans several steps), which a preemption drops with the row
(the request recomputes its prompt, reading no prefix cache, see
`kv_cache_manager`). Steps without embedding requests pay one dict check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.worker.step_inputs import StepInputs


@dataclass(slots=True)
class PoolRows:
    """A step's embedding requests: positions in the step, and which of them end
    their prompt in it (those are pooled now)."""

    index: list[int]
    done: list[bool]


class Pooler:
    def __init__(self) -> None:
        # request id -> pooling type, for the embedding requests in the batch
        self.kinds: dict[int, str] = {}
        # request id -> the sum of its hidden states so far (mean pooling)
        self._sums: dict[int, torch.Tensor] = {}

    def add(self, req_id: int, pooling: str) -> None:
        self.kinds[req_id] = pooling

    def remove(self, req_id: int) -> None:
        """The request left the batch (finished, aborted or preempted)."""
        if self.kinds.pop(req_id, None) is not None:
            self._sums.pop(req_id, None)

    def split(self, step: StepInputs) -> PoolRows | None:
        """Take the step's embedding requests out of its sampled rows; None when
        the step has none."""
        kinds = self.kinds
        if not kinds:
            return None
        index = [i for i, rid in enumerate(step.req_ids) if rid in kinds]
        if not index:
            return None
        done = step.sampled[index].tolist()
        step.sampled[index] = False
        return PoolRows(index, done)

    def pool(
        self, step: StepInputs, rows: PoolRows, hidden: torch.Tensor, num_prompt: np.ndarray
    ) -> dict[int, np.ndarray]:
        """Add this step's hidden states of the mean-pooled requests to their sums,
        and return the pooled vector (float32, on the host) of every request whose
        prompt ended here. `num_prompt` is each step row's prompt length."""
        ends = step.cu_query_lens
        pooled: dict[int, np.ndarray] = {}
        for i, done in zip(rows.index, rows.done, strict=True):
            rid = step.req_ids[i]
            end = int(ends[i])
            if self.kinds[rid] == "last":
                if done:
                    pooled[rid] = _host(hidden[end - 1])
                continue
            chunk = hidden[end - int(step.query_lens[i]) : end].float().sum(0)
            total = self._sums.get(rid)
            total = chunk if total is None else total + chunk
            if done:
                self._sums.pop(rid, None)
                pooled[rid] = _host(total / int(num_prompt[i]))
            else:
                self._sums[rid] = total
        return pooled


def _host(vector: torch.Tensor) -> np.ndarray:
    return vector.float().cpu().numpy()
