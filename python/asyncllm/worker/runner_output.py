"""What a model runner returns for one step (no torch here: the null runner and
the engine core use it without importing the model stack)."""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm.messages import Logprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # complete prompt logprobs, delivered once the whole prompt has been computed
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)
