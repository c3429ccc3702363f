"""What a model runner returns for one step (no torch here: the null runner and
the engine core use it without importing the model stack)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncllm.messages import Logprobs


@dataclass(slots=True)
class ModelRunnerOutput:
    sampled: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # complete prompt logprobs, delivered once the whole prompt has been computed
    prompt_logprobs: dict[int, Logprobs] = field(default_factory=dict)
    # With overlap scheduling the runner returns before the sampled tokens reach
    # the host: this call waits for them and gives `sampled` (the stepper calls it).
    resolve: Callable[[], dict[int, int]] | None = None
    # Speculative decoding: the tokens of each request that verified drafts (the
    # accepted drafts, then one more; not in `sampled`), and the drafts proposed
    # for each request's next step.
    verified: dict[int, list[int]] | None = None
    drafts: dict[int, list[int]] | None = None
    # Embedding requests whose prompt ended this step: their pooled hidden state
    # (a float32 numpy vector); nothing was sampled for them.
    pooled: dict[int, Any] = field(default_factory=dict)

    def resolved(self) -> ModelRunnerOutput:
        """This output with `sampled` filled in (waits for the device if needed)."""
        if self.resolve is not None:
            self.sampled, self.resolve = self.resolve(), None
        return self
