"""What crosses between the front end and the engine core (in process for now;
the wire codec carries the same fields)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncllm.core.scheduler import SchedulerStats
from asyncllm.sampling_params import SamplingParams


@dataclass(slots=True)
class Logprobs:
    """Logprobs of K positions: `token_ids[k][0]` is the sampled (or actual) token,
    followed by the top-N; `logprobs` likewise; `ranks[k]` is the sampled token's
    rank in the model's distribution (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    """One request's progress in one step."""

    request_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | None = None  # the stop token id, when a stop token ended it
    logprobs: Logprobs | None = None
    prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineCoreOutputs:
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None
    timestamp: float = 0.0
