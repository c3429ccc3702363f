"""The runner's persistent per-request state, kept in preallocated arrays.

A request gets a row when it is first scheduled and keeps it until it finishes or
is preempted, so a decode step only touches the numbers that changed: the new
token, the new block. Per-step inputs are then gathered from these rows with a
few vectorised numpy operations instead of per-request Python work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.sampling_params import SamplingParams


@dataclass(slots=True)
class RowState:
    """What the runner remembers of a request beyond the arrays."""

    req_id: int
    params: SamplingParams
    stop_token_ids: list[int]
    generator: torch.Generator | None


class InputBatch:
    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_computed = np.zeros(max_num_seqs, dtype=np.int32)
        self.block_table = np.zeros((max_num_seqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int32)
        # sampling parameters, one entry per row
        self.temperature = np.ones(max_num_seqs, dtype=np.float32)
        self.top_p = np.ones(max_num_seqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_seqs, dtype=np.int64)  # 0 = off
        self.min_p = np.zeros(max_num_seqs, dtype=np.float32)
        self.repetition_penalty = np.ones(max_num_seqs, dtype=np.float32)
        self.frequency_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.presence_penalty = np.zeros(max_num_seqs, dtype=np.float32)
        self.greedy = np.ones(max_num_seqs, dtype=bool)
        self.has_penalty = np.zeros(max_num_seqs, dtype=bool)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int32)  # -1 = none
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int32)
        self.rows: dict[int, int] = {}
        self.states: list[RowState | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, new: NewRequestData, generator: torch.Generator | None) -> int:
        row = self._free_rows.pop()
        self.rows[new.req_id] = row
        n = len(new.token_ids)
        self.token_ids[row, :n] = new.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = new.num_prompt_tokens
        self.num_computed[row] = new.num_computed_tokens
        nb = len(new.block_ids)
        self.block_table[row, :nb] = new.block_ids
        self.num_blocks[row] = nb
        p = new.sampling_params
        self.greedy[row] = p.greedy
        self.temperature[row] = 1.0 if p.greedy else p.temperature
        self.top_p[row] = p.top_p
        self.top_k[row] = max(p.top_k, 0)
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.has_penalty[row] = p.has_penalties
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        self.states[row] = RowState(new.req_id, p, sorted(new.stop_token_ids), generator)
        return row

    def remove(self, req_id: int) -> RowState | None:
        row = self.rows.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        self.states[row] = None
        self._free_rows.append(row)
        return state

    def append_blocks(self, req_id: int, block_ids: list[int]) -> None:
        row = self.rows[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
