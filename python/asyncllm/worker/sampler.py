"""Batched sampling: logit bias, allowed tokens, bad words, penalties,
min-tokens masking, greedy, temperature, top-k,
top-p, min-p, per-request seeds, and logprobs of the raw model distribution.

On CPU one call of the Rust kernel samples every row (`sampler_kernel`); on other
devices the torch sampler of the same semantics (`sampler_torch`)
does, and an all-greedy batch there costs one argmax. Random draws come from a
counter-based generator keyed by the request's seed (or the engine's seed and the
request's id) and its output position, so a request's tokens never depend on the
batch, on preemption or on step order.
"""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.worker.input_batch import I_SEED, I_STREAM
from asyncllm.worker.sampler_kernel import sample_cpu
from asyncllm.worker.sampler_output import SamplerOutput
from asyncllm.worker.sampler_torch import sample_torch
from asyncllm.worker.sampling_metadata import SamplingMetadata
from asyncllm.worker.token_rules import merge_allowed


class Sampler:
    """The runner's one sampling call per step; picks the kernel or the torch sampler."""

    def __init__(self, engine_seed: int) -> None:
        # unseeded requests draw under the engine's seed
        seed = engine_seed & (2**64 - 1)
        self._engine_seed = np.array(seed, dtype=np.uint64).view(np.int64)

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        unseeded = md.params_i[:, I_STREAM] != 0
        if unseeded.any():
            md.params_i[unseeded, I_SEED] = self._engine_seed
        if md.allowed_tokens is not None:  # allowed_token_ids: masks as a grammar's
            md.allowed = merge_allowed(md.allowed, md.allowed_tokens, logits.shape[1])
        if logits.device.type == "cpu":
            return sample_cpu(logits, md)
        # rows without a finite maximum are logged when the host reads the step's
        # tokens (worker/in_flight.py), so that nothing here waits for the device
        return sample_torch(logits, md)
