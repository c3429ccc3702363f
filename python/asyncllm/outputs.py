"""What `LLM.generate` and `AsyncLLM.generate` return (vLLM's names and fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the model's most likely token
    decoded_token: str | None = None


# One dict per position: token id -> its Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# The first prompt token has no logprob: nothing predicts it.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    # Prompt tokens whose KV came from the prefix cache instead of being computed;
    # None until the engine reports it (with the request's first output token).
    num_cached_tokens: int | None = None


@dataclass(slots=True)
class EmbeddingOutput:
    """One prompt's embedding (vLLM's name): the pooled, finished vector."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput:
    """What `LLM.embed` and `AsyncLLM.embed` return for one prompt (vLLM's shape:
    `out.outputs.embedding`)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    # Prompt tokens whose KV came from the prefix cache (last-token pooling only).
    num_cached_tokens: int | None = None
