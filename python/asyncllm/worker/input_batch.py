"""The runner's persistent per-request state, kept in preallocated arrays.

A request gets a row when it is first scheduled and keeps it until it finishes or
is preempted, so a decode step only touches the numbers that changed: the new
token, the new block. Per-step inputs are then gathered from these rows with a
few vectorised numpy operations instead of per-request Python work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker.token_rules import RowTokenRules, row_token_rules

# Columns of `InputBatch.sample_f` (float32) and `sample_i` (int64): the sampler's
# per-row parameters, packed in the layout `_core._sample` reads (rust/py/sampler.rs).
F_TEMPERATURE, F_TOP_P, F_MIN_P, F_REPETITION, F_FREQUENCY, F_PRESENCE = range(6)
I_GREEDY, I_TOP_K, I_NUM_LOGPROBS, I_SEED, I_STREAM, I_POSITION = range(6)
# An unseeded request's random stream: this bit plus its id, under the engine's
# seed; a seeded one's is 0 under its own seed (rust/sampler/philox.rs).
UNSEEDED_STREAM = 1 << 63


@dataclass(slots=True)
class RowState:
    """What the runner remembers of a request beyond the arrays."""

    req_id: int
    params: SamplingParams
    stop_token_ids: list[int]
    # the prompt's distinct tokens (sorted), for penalties; None without them
    prompt_tokens: np.ndarray | None = None
    # logit bias, allowed tokens, bad words (worker/token_rules.py); None without
    rules: RowTokenRules | None = None


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
        # sampling parameters, one row per request, set once when it is added:
        # a step gathers them with one fancy index (columns F_* and I_* above)
        self.sample_f = np.zeros((max_num_seqs, 6), dtype=np.float32)
        self.sample_i = np.zeros((max_num_seqs, 6), dtype=np.int64)
        self.greedy = np.ones(max_num_seqs, dtype=bool)
        self.has_penalty = np.zeros(max_num_seqs, dtype=bool)
        self.min_tokens = np.zeros(max_num_seqs, dtype=np.int32)
        self.num_logprobs = np.full(max_num_seqs, -1, dtype=np.int32)  # -1 = none
        self.num_prompt_logprobs = np.full(max_num_seqs, -1, dtype=np.int32)
        # rows whose request has token rules: a step without any checks this once
        self.num_token_rules = 0
        self.rows: dict[int, int] = {}
        self.states: list[RowState | None] = [None] * max_num_seqs
        self._free_rows = list(range(max_num_seqs - 1, -1, -1))

    def add(self, new: NewRequestData) -> int:
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
        self.sample_f[row] = (
            1.0 if p.greedy else p.temperature,
            p.top_p,
            p.min_p,
            p.repetition_penalty,
            p.frequency_penalty,
            p.presence_penalty,
        )
        seeded = p.seed is not None
        # seeds and streams are uint64, kept as their int64 bit patterns
        seed = np.array(p.seed if seeded else 0, dtype=np.uint64).view(np.int64)
        stream = np.array(0 if seeded else UNSEEDED_STREAM | new.req_id, dtype=np.uint64)
        self.sample_i[row] = (
            p.greedy,
            max(p.top_k, 0),
            -1 if p.logprobs is None else p.logprobs,
            seed,
            stream.view(np.int64),
            0,  # the output position, set each step
        )
        self.has_penalty[row] = p.has_penalties
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        self.num_prompt_logprobs[row] = -1 if p.prompt_logprobs is None else p.prompt_logprobs
        prompt_tokens = None
        if p.has_penalties:
            prompt_tokens = np.unique(self.token_ids[row, : new.num_prompt_tokens])
        rules = row_token_rules(p)
        self.num_token_rules += rules is not None
        self.states[row] = RowState(new.req_id, p, sorted(new.stop_token_ids), prompt_tokens, rules)
        return row

    def remove(self, req_id: int) -> RowState | None:
        row = self.rows.pop(req_id, None)
        if row is None:
            return None
        state = self.states[row]
        if state is not None and state.rules is not None:
            self.num_token_rules -= 1
        self.states[row] = None
        self._free_rows.append(row)
        return state

    def append_blocks(self, req_id: int, block_ids: list[int]) -> None:
        row = self.rows[req_id]
        start = self.num_blocks[row]
        self.block_table[row, start : start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)
