"""What sampling a step returns, whichever sampler ran (the CPU kernel,
`sampler_kernel`, or the torch sampler, `sampler_torch`): the model runner reads
only this."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [n] int64
    # logprobs of the raw model distribution: ids/values [n, 1 + N] (sampled first), ranks [n]
    logprob_ids: torch.Tensor | None = None
    logprob_values: torch.Tensor | None = None
    logprob_ranks: torch.Tensor | None = None
    # [n] bool: rows whose logits had no finite maximum (sampled as their argmax);
    # None: no such row. A device tensor on CUDA: reading it waits for the step.
    nonfinite: torch.Tensor | None = None

    def nonfinite_rows(self) -> list[int]:
        """The rows of `nonfinite` (waits for the device)."""
        if self.nonfinite is None:
            return []
        return self.nonfinite.nonzero().flatten().tolist()  # type: ignore[no-any-return]
