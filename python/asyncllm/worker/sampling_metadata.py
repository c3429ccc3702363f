"""Builds a step's `SamplingMetadata` from the persistent rows: only the stages
some request in the batch needs are prepared."""

from __future__ import annotations

import numpy as np
import torch

from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.sampler import Penalties, SamplingMetadata


def build_sampling_metadata(
    ib: InputBatch, rows: np.ndarray, vocab_size: int, device: torch.device
) -> SamplingMetadata:
    greedy = ib.greedy[rows]
    all_greedy = bool(greedy.all())
    num_out = ib.num_tokens[rows] - ib.num_prompt_tokens[rows]
    blocked = np.flatnonzero(num_out < ib.min_tokens[rows])
    min_tokens_rows = []
    for i in blocked.tolist():
        state = ib.states[rows[i]]
        assert state is not None
        if state.stop_token_ids:
            min_tokens_rows.append((i, state.stop_token_ids))
    num_logprobs = ib.num_logprobs[rows]
    max_num_logprobs = int(num_logprobs.max()) if (num_logprobs >= 0).any() else None
    penalties = None
    if ib.has_penalty[rows].any():
        penalties = _build_penalties(ib, rows, vocab_size, device)
    if all_greedy:
        return SamplingMetadata(
            all_greedy=True,
            greedy_mask=None,
            temperature=None,
            top_k=None,
            top_p=None,
            min_p=None,
            generators={},
            penalties=penalties,
            min_tokens_rows=min_tokens_rows,
            max_num_logprobs=max_num_logprobs,
        )
    top_k = ib.top_k[rows]
    top_p = ib.top_p[rows]
    min_p = ib.min_p[rows]
    random_rows = np.flatnonzero(~greedy)
    generators = {}
    for i in random_rows.tolist():
        state = ib.states[rows[i]]
        if state is not None and state.generator is not None:
            generators[i] = state.generator
    return SamplingMetadata(
        all_greedy=False,
        greedy_mask=torch.from_numpy(greedy).to(device),
        temperature=torch.from_numpy(ib.temperature[rows]).to(device).unsqueeze(1),
        top_k=(
            torch.from_numpy(np.where(top_k > 0, top_k, vocab_size)).to(device)
            if (top_k > 0).any()
            else None
        ),
        top_p=torch.from_numpy(top_p).to(device) if (top_p < 1.0).any() else None,
        min_p=torch.from_numpy(min_p).to(device) if (min_p > 0.0).any() else None,
        generators=generators,
        penalties=penalties,
        min_tokens_rows=min_tokens_rows,
        max_num_logprobs=max_num_logprobs,
    )


def _build_penalties(
    ib: InputBatch, rows: np.ndarray, vocab_size: int, device: torch.device
) -> Penalties:
    n = len(rows)
    prompt_mask = torch.zeros((n, vocab_size), dtype=torch.bool)
    counts = torch.zeros((n, vocab_size), dtype=torch.float32)
    for i, row in enumerate(rows.tolist()):
        if not ib.has_penalty[row]:
            continue
        n_prompt = int(ib.num_prompt_tokens[row])
        n_total = int(ib.num_tokens[row])
        prompt = torch.from_numpy(ib.token_ids[row, :n_prompt].astype(np.int64))
        prompt_mask[i, prompt] = True
        if n_total > n_prompt:
            outputs = torch.from_numpy(ib.token_ids[row, n_prompt:n_total].astype(np.int64))
            counts[i] = torch.bincount(outputs, minlength=vocab_size)[:vocab_size].float()
    return Penalties(
        repetition=torch.from_numpy(ib.repetition_penalty[rows]).to(device),
        frequency=torch.from_numpy(ib.frequency_penalty[rows]).to(device),
        presence=torch.from_numpy(ib.presence_penalty[rows]).to(device),
        prompt_mask=prompt_mask.to(device),
        output_counts=counts.to(device),
    )
