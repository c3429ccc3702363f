"""A model runner that runs no model: for measuring everything around the model.

It samples a deterministic token per request (a function of the request id and
its position) and, optionally, sleeps for a fixed time per step with the GIL
released, standing in for an accelerator's forward pass. Selected with
`EngineArgs(executor="null")`; a benchmarking tool, never a default.
"""

from __future__ import annotations

import time
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.worker.runner_output import ModelRunnerOutput

_FIRST_TOKEN = 3  # stay clear of the usual special ids (pad, bos, eos)


def null_token(req_id: int, position: int, vocab_size: int) -> int:
    """The token the null runner samples for a request at a position (inlined in
    `execute_model`)."""
    return _FIRST_TOKEN + (req_id * 7919 + position * 104729) % (vocab_size - _FIRST_TOKEN)


class NullModelRunner:
    def __init__(self, config: EngineConfig, hf_config: Any) -> None:
        self.vocab_size = int(hf_config.vocab_size)
        blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.num_blocks = config.num_kv_blocks or config.max_num_seqs * blocks_per_seq
        self.delay_s = config.null_step_delay_ms / 1000.0
        # req_id -> [num_computed_tokens, num_tokens]
        self._progress: dict[int, list[int]] = {}

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        progress = self._progress
        for rid in so.finished_req_ids:
            progress.pop(rid, None)
        for rid in so.preempted_req_ids:
            progress.pop(rid, None)
        for new in so.new_reqs:
            progress[new.req_id] = [new.num_computed_tokens, len(new.token_ids)]
        if self.delay_s:
            time.sleep(self.delay_s)
        sampled = {}
        vocab = self.vocab_size - _FIRST_TOKEN
        for rid, n in so.num_scheduled_tokens.items():
            state = progress[rid]
            done = state[0] = state[0] + n
            if done == state[1]:
                sampled[rid] = _FIRST_TOKEN + (rid * 7919 + done * 104729) % vocab
                state[1] = done + 1
        return ModelRunnerOutput(sampled=sampled)
