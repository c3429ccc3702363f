"""Rank 0 -> workers: each step's model inputs, once per step, without pickle.

A step is one gloo broadcast on the step group (host tensors, also under
NCCL) of a fixed-size int64 buffer: a header and, when it fits in `INLINE`
values (a 256-request decode step with ~100 tokens of context each does), the
payload; a larger payload follows in a second broadcast of its exact size.

    header   int64[10]: kind, num_tokens T, num_seqs n, block-table width nb,
             sampled rows s, extra-logits flag, extra rows, payload inline,
             LoRA map length L (T or 0), LoRA events length e
    payload  int64[3T + 2n + n * nb + s + L + e]: input ids [T], positions [T],
             query lengths [n], context lengths [n], block tables [n, nb], slot
             mapping [T], the rows whose logits are sampled [s], with LoRA each
             token's adapter slot [L] (none when no token has an adapter) and
             rank 0's adapter events since the last step [e] (lora/ranks.py)

One message, not a header then a payload: each broadcast is a wake-up of every
worker, which on a busy CPU costs more than copying 32 KB
(benches/bench_parallel.py, tp-comm). No pickle, no per-request Python: the
payload is the runner's own numpy arrays, concatenated: exactly what rank 0's
runner feeds `build_attention_metadata` and the model, so every rank builds the
same metadata and runs the same forward pass. Logits are computed for the
sampled rows only and gathered to rank 0.

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
_NONE = np.empty(0, dtype=np.int64)
HEADER_LEN = 10
INLINE = 4096  # payload values carried in the header's broadcast (32 KB in all)


class _Channel:
    """What both ends hold: the group and the header buffer it broadcasts."""

    def __init__(self, group: Any, hidden_size: int, dtype: torch.dtype) -> None:
        self.group = group
        self.hidden_size = hidden_size
        self.dtype = dtype
        self._buf = torch.zeros(HEADER_LEN + INLINE, dtype=torch.int64)
        self._a = self._buf.numpy()


class StepSender(_Channel):
    """Rank 0's end of the channel (the runner calls it once per step)."""

    def __init__(self, group: Any, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__(group, hidden_size, dtype)
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
        lora_slots: np.ndarray | None = None,
        lora_events: np.ndarray | None = None,
    ) -> None:
        t, n, nb, s = len(input_ids), len(query_lens), block_tables.shape[1], len(sample_rows)
        lora_slots = _NONE if lora_slots is None else lora_slots
        lora_events = _NONE if lora_events is None else lora_events
        size = 3 * t + 2 * n + n * nb + s + len(lora_slots) + len(lora_events)
        parts = (
            input_ids,
            positions,
            query_lens,
            context_lens,
            block_tables.ravel(),
            slot_mapping,
            sample_rows,
            lora_slots,
            lora_events,
        )
        a = self._a
        header = (STEP, t, n, nb, s, extra_logits, 0, size <= INLINE)
        a[:HEADER_LEN] = (*header, len(lora_slots), len(lora_events))
        if size <= INLINE:
            np.concatenate(parts, out=a[HEADER_LEN : HEADER_LEN + size], casting="unsafe")
            dist.broadcast(self._buf, 0, group=self.group)
        else:
            payload = np.concatenate(parts, dtype=np.int64, casting="unsafe")
            dist.broadcast(self._buf, 0, group=self.group)
            dist.broadcast(torch.from_numpy(payload), 0, group=self.group)
        self.extra_logits = extra_logits

    def send_rows(self, hidden: torch.Tensor) -> None:
        """Before an extra `compute_logits(hidden)` on rank 0: the workers' copy."""
        self._send_kind(LOGITS, hidden.shape[0])
        rows = hidden.detach().to("cpu", self.dtype).contiguous()
        dist.broadcast(rows, 0, group=self.group)

    def end_logits(self) -> None:
        """After the prompt-logprobs calls of a step."""
        if self.extra_logits:
            self.extra_logits = False
            self._send_kind(END_LOGITS)

    def stop(self) -> None:
        self._send_kind(STOP)

    def _send_kind(self, kind: int, rows: int = 0) -> None:
        self._a[:HEADER_LEN] = (kind, 0, 0, 0, 0, 0, rows, 0, 0, 0)
        dist.broadcast(self._buf, 0, group=self.group)


class StepReceiver(_Channel):
    """A worker's end: `recv_header`, then the payload or rows it announces."""

    def recv_header(self) -> list[int]:
        dist.broadcast(self._buf, 0, group=self.group)
        return self._a[:HEADER_LEN].tolist()  # type: ignore[no-any-return]

    def recv_step(self, header: list[int]) -> tuple[np.ndarray, ...]:
        """(input ids, positions, query lens, context lens, block tables, slots,
        sampled rows, LoRA slots, LoRA events) as rank 0 sent them."""
        _, t, n, nb, s = header[:5]
        lt, le = header[8:10]
        size = 3 * t + 2 * n + n * nb + s + lt + le
        if header[7]:
            a = self._a[HEADER_LEN : HEADER_LEN + size].copy()
        else:
            payload = torch.empty(size, dtype=torch.int64)
            dist.broadcast(payload, 0, group=self.group)
            a = payload.numpy()
        ends = np.cumsum([t, t, n, n, n * nb, t, s, lt, le])
        ids, pos, q, ctx, bt, slots, rows, lora_slots, lora_events, _ = np.split(a, ends)
        return ids, pos, q, ctx, bt.reshape(n, nb), slots, rows, lora_slots, lora_events

    def recv_rows(self, header: list[int]) -> torch.Tensor:
        rows = torch.empty(header[6], self.hidden_size, dtype=self.dtype)
        dist.broadcast(rows, 0, group=self.group)
        return rows
