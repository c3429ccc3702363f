"""What crosses between the front end and the engine core, and what a model runner
hands back (`Logprobs`). A leaf: it imports only `_core` and `sampling_params`, so
the front end, the engine and the worker may all use it.

Requests travel as `EngineCoreRequest`s (on the wire: `_core.AddRequest`); a step's
outputs leave the core as `StepOutputs` columns, which the Rust codec encodes as
one frame. The front end only ever reads the decoded `_core.OutputBatch`, in
process or across the process boundary, so both paths share one output code path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from asyncllm._core import Logprobs, SchedulerStats, encode_output_batch
from asyncllm.sampling_params import SamplingParams

__all__ = ["EngineCoreRequest", "Logprobs", "SchedulerStats", "StepOutputs"]


@dataclass(slots=True)
class EngineCoreRequest:
    request_id: int
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    priority: int = 0
    # None: generate. "last" / "mean" (pooling_params.POOLING_TYPES): an embedding
    # request; the core pools its prompt's hidden states and samples nothing.
    pooling: str | None = None
    # its LoRA adapter (asyncllm.lora.LoRARequest's fields); 0: the base model
    lora_int_id: int = 0
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass(slots=True)
class StepOutputs:
    """One step's outputs as columns: entry i of each belongs to `req_ids[i]`. An
    optional column is None when no request has a value in it."""

    req_ids: list[int]
    # per request a list of new ids, or flat (one int per request), which a step
    # always is and which encodes cheapest
    new_token_ids: list[list[int]] | list[int]
    stats: SchedulerStats
    timestamp: float
    finish_reasons: list[str | None] | None = None  # "stop", "length", "abort", "error"
    stop_reasons: list[int | None] | None = None  # the stop token that ended a request
    errors: list[str | None] | None = None  # why a request failed on its own
    logprobs: list[Logprobs | None] | None = None
    prompt_logprobs: list[Logprobs | None] | None = None
    # prompt tokens found in the prefix cache, on each request's first output only
    num_cached_tokens: list[int | None] | None = None
    # the pooled hidden state (float32) of each embedding request that finished
    embeddings: list[Any | None] | None = None

    def encode(self) -> bytes:
        return encode_output_batch(
            self.req_ids,
            self.new_token_ids,
            self.stats,
            self.timestamp,
            finish_reasons=self.finish_reasons,  # type: ignore[arg-type]
            stop_reasons=self.stop_reasons,
            errors=self.errors,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.num_cached_tokens,
            embeddings=self.embeddings,
        )
