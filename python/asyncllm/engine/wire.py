"""Requests between their Python form and the wire's `_core.AddRequest`.

The front end resolves everything a request needs before it leaves (a concrete
`max_tokens`, say), so the core rebuilds its `SamplingParams` from the wire alone.
"""

from __future__ import annotations

from asyncllm._core import AddRequest
from asyncllm.messages import EngineCoreRequest
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured_output.params import StructuredOutputsParams
from asyncllm.token_checks import clamp_max_tokens


def to_wire(req: EngineCoreRequest, max_model_len: int) -> AddRequest:
    p = req.sampling_params
    so = p.structured_outputs
    return AddRequest(
        req.request_id,
        req.prompt_token_ids,
        arrival_time=req.arrival_time,
        priority=req.priority,
        max_tokens=clamp_max_tokens(p.max_tokens, len(req.prompt_token_ids), max_model_len),
        min_tokens=p.min_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.seed,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs,
        prompt_logprobs=p.prompt_logprobs,
        repetition_penalty=p.repetition_penalty,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        cache_salt=p.cache_salt,
        structured_outputs=None if so is None else (so.kind, so.spec()),
    )


def from_wire(add: AddRequest) -> EngineCoreRequest:
    """Raises ConfigError when the wire carries values SamplingParams rejects."""
    so = add.structured_outputs
    params = SamplingParams(
        max_tokens=add.max_tokens,
        min_tokens=min(add.min_tokens, add.max_tokens),
        temperature=add.temperature,
        top_p=add.top_p,
        top_k=add.top_k,
        min_p=add.min_p,
        seed=add.seed,
        stop_token_ids=add.stop_token_ids,
        ignore_eos=add.ignore_eos,
        logprobs=add.logprobs,
        prompt_logprobs=add.prompt_logprobs,
        repetition_penalty=add.repetition_penalty,
        frequency_penalty=add.frequency_penalty,
        presence_penalty=add.presence_penalty,
        cache_salt=add.cache_salt,
        structured_outputs=None if so is None else StructuredOutputsParams.from_spec(*so),
    )
    return EngineCoreRequest(
        add.wire_id, add.prompt_token_ids, params, add.arrival_time, add.priority
    )
