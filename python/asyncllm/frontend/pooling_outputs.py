"""The front end's side of embedding requests: what goes to the core, and the
`EmbeddingRequestOutput` that comes back.

An embedding request is one core request that samples nothing: it finishes in
the step its prompt is computed, with the pooled vector on its one output. It
skips the detokenizer and the per-token loop of `OutputProcessor` altogether;
`PoolingOutputs.process` reads a batch only while some embedding request is
open, so generation steps pay one check per batch for it.
"""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm._core import OutputBatch
from asyncllm.errors import InvalidRequestError
from asyncllm.messages import EngineCoreRequest
from asyncllm.outputs import EmbeddingOutput, EmbeddingRequestOutput
from asyncllm.pooling_params import PoolingParams, finish_embedding
from asyncllm.sampling_params import RequestOutputKind, SamplingParams

# What an embedding request carries as sampling parameters: one position, which
# the core never samples (the request finishes when its prompt is computed).
EMBED_SAMPLING = SamplingParams(
    max_tokens=1, temperature=0.0, output_kind=RequestOutputKind.FINAL_ONLY
)


def check_pooling_params(params: PoolingParams, hidden_size: int) -> None:
    """Raises InvalidRequestError when `dimensions` asks for more values than the
    model's hidden states have (truncation cannot add any)."""
    if params.dimensions is not None and params.dimensions > hidden_size:
        raise InvalidRequestError(
            f"dimensions={params.dimensions} is larger than the model's hidden size ({hidden_size})"
        )


def embedding_request(
    core_id: int, prompt_ids: list[int], params: PoolingParams
) -> EngineCoreRequest:
    return EngineCoreRequest(core_id, prompt_ids, EMBED_SAMPLING, pooling=params.pooling)


@dataclass
class EmbeddingState:
    """One embedding request in the front end."""

    request_id: str
    prompt_token_ids: list[int]
    params: PoolingParams
    core_id: int
    # set when the core failed the request, or it was aborted
    error: str | None = None
    finished: bool = False


class PoolingOutputs:
    def __init__(self) -> None:
        self.requests: dict[int, EmbeddingState] = {}  # by core id

    def add(self, state: EmbeddingState) -> None:
        self.requests[state.core_id] = state

    def process(self, batch: OutputBatch) -> list[EmbeddingRequestOutput]:
        """The outputs of the embedding requests that finished in `batch` (an
        error or abort gives an empty vector and sets the state's `error`)."""
        finished = batch.finished_indices
        if not finished:
            return []
        wire_ids = batch.wire_ids
        requests = self.requests
        mine = [i for i in finished if wire_ids[i] in requests]
        if not mine:
            return []
        vectors = batch.embeddings
        cached = batch.num_cached_tokens
        outputs = []
        for i in mine:
            state = requests.pop(wire_ids[i])
            vector = vectors.get(i)
            if vector is None:
                reason = batch.finish_reasons[i]
                state.error = (
                    (batch.errors[i] or "the engine core rejected the request")
                    if reason == "error"
                    else f"the request ended ({reason}) before its embedding was computed"
                )
            outputs.append(self._finish(state, vector or [], cached.get(i)))
        return outputs

    def abort(self, core_ids: list[int]) -> list[EmbeddingRequestOutput]:
        """Finish the open embedding requests among `core_ids` as aborted."""
        outputs = []
        for core_id in core_ids:
            state = self.requests.pop(core_id, None)
            if state is not None:
                state.error = f"request {state.request_id!r} was aborted"
                outputs.append(self._finish(state, [], None))
        return outputs

    @staticmethod
    def _finish(
        state: EmbeddingState, vector: list[float], num_cached: int | None
    ) -> EmbeddingRequestOutput:
        state.finished = True
        embedding = finish_embedding(vector, state.params) if vector else []
        return EmbeddingRequestOutput(
            state.request_id,
            state.prompt_token_ids,
            EmbeddingOutput(embedding),
            True,
            num_cached,
        )
