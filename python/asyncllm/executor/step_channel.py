"""Rank 0 -> workers: each step's model inputs, once per step, without pickle.

A step is two gloo broadcasts on the step group (host tensors, also under NCCL):

    header   int64[8]: kind, num_tokens T, num_seqs n, block-table width nb,
             sampled rows s, extra-logits flag, extra rows, 0
    payload  int64[3T + 2n + n * nb + s]: input ids [T], positions [T], query
             lengths [n], context lengths [n], block tables [n, nb], slot
             mapping [T], the rows whose logits are sampled [s]

which is exactly what rank 0's runner feeds `build_attention_metadata` and the
model, so every rank builds the same metadata and runs the same forward pass
(benches/bench_parallel.py measures this against a 256-request step). Logits are
computed for the sampled rows only and gathered to rank 0.

Prompt logprobs score more rows than the sampled ones, from runner state the
workers do not keep; with the extra-logits flag set, each further
`compute_logits` call on rank 0 first sends a LOGITS header and the hidden rows,
and END_LOGITS closes the list before the sampled rows' logits.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

STEP, LOGITS, END_LOGITS, STOP = 1, 2, 3, 4
HEADER_LEN = 8


class StepSender:
    """Rank 0's end of the channel (the runner calls it once per step)."""

    def __init__(self, group: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        self._h = self._header.numpy()
        # within a step with prompt logprobs: compute_logits calls go to the workers
        self.extra_logits = False

    def send_step(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        query_lens: np.ndarray,
        context_lens: np.ndarray,
        block_tables: np.ndarray,
        slot_mapping: np.ndarray,
        sample_rows: np.ndarray,
        extra_logits: bool,
    ) -> None:
        h = self._h
        h[0], h[1], h[2], h[3] = STEP, len(input_ids), len(query_lens), block_tables.shape[1]
        h[4], h[5] = len(sample_rows), extra_logits
        payload = np.concatenate(
            (
                input_ids,
                positions,
                query_lens,
                context_lens,
                block_tables.ravel(),
                slot_mapping,
                sample_rows,
            ),
            dtype=np.int64,
            casting="unsafe",
        )
        dist.broadcast(self._header, 0, group=self.group)
        dist.broadcast(torch.from_numpy(payload), 0, group=self.group)
        self.extra_logits = extra_logits

    def send_rows(self, hidden: torch.Tensor) -> None:
        """Before an extra `compute_logits(hidden)` on rank 0: the workers' copy."""
        h = self._h
        h[:] = 0
        h[0], h[6] = LOGITS, hidden.shape[0]
        dist.broadcast(self._header, 0, group=self.group)
        rows = hidden.detach().to("cpu", self.dtype).contiguous()
        dist.broadcast(rows, 0, group=self.group)

    def end_logits(self) -> None:
        """After the prompt-logprobs calls of a step."""
        if self.extra_logits:
            self.extra_logits = False
            self._send_kind(END_LOGITS)

    def stop(self) -> None:
        self._send_kind(STOP)

    def _send_kind(self, kind: int) -> None:
        self._h[:] = 0
        self._h[0] = kind
        dist.broadcast(self._header, 0, group=self.group)


class StepReceiver:
    """A worker's end: `recv_header`, then the payload or rows it announces."""

    def __init__(self, group: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._header = torch.zeros(HEADER_LEN, dtype=torch.int64)

    def recv_header(self) -> list[int]:
        dist.broadcast(self._header, 0, group=self.group)
        return self._header.tolist()  # type: ignore[no-any-return]

    def recv_step(self, header: list[int]) -> tuple[np.ndarray, ...]:
        """(input ids, positions, query lens, context lens, block tables, slots,
        sampled rows) as rank 0 sent them."""
        _, t, n, nb, s = header[:5]
        payload = torch.empty(3 * t + 2 * n + n * nb + s, dtype=torch.int64)
        dist.broadcast(payload, 0, group=self.group)
        a = payload.numpy()
        ends = np.cumsum([t, t, n, n, n * nb, t, s])
        ids, pos, q, ctx, bt, slots, rows, _ = np.split(a, ends)
        return ids, pos, q, ctx, bt.reshape(n, nb), slots, rows

    def recv_rows(self, header: list[int]) -> torch.Tensor:
        rows = torch.empty(header[6], self.hidden_size, dtype=self.dtype)
        dist.broadcast(rows, 0, group=self.group)
        return rows
