"""What the scheduler hands the model runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from asyncllm.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no row for: first scheduled, or resumed after
    preemption (then `token_ids` includes the tokens generated before it)."""

    req_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    stop_token_ids: frozenset[int]
    # the compiled output constraint (`_core.Grammar`), or None
    grammar: Any = None
    # an embedding request's pooling type ("last" or "mean"); None: it generates
    pooling: str | None = None
    # its adapter (`lora.adapters.LoadedAdapter`), or None: the base model
    lora: Any = None


@dataclass(slots=True)
class SchedulerOutput:
    """One step's plan. `num_scheduled_tokens` is in batch order: running requests
    first, then new ones. Requests of `finished_req_ids` and `preempted_req_ids`
    left the batch since the previous step; the runner drops their rows."""

    new_reqs: list[NewRequestData]
    # req_id -> block ids appended to a running request's table this step
    new_block_ids: dict[int, list[int]]
    num_scheduled_tokens: dict[int, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[int] = field(default_factory=set)
    preempted_req_ids: set[int] = field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens this step verifies, after
    # its last known token (its num_scheduled_tokens counts them: 1 + drafts)
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0
