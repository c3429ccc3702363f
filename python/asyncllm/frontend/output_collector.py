"""Where one request's outputs wait for its consumer.

Holds at most one pending `RequestOutput` (or an embedding request's one
`EmbeddingRequestOutput`): when the consumer lags, DELTA outputs merge into it and
CUMULATIVE (or FINAL_ONLY) ones replace it, so a slow consumer never builds a
queue.
"""

from __future__ import annotations

import asyncio
from typing import Generic, TypeVar, cast

from asyncllm.outputs import EmbeddingRequestOutput, RequestOutput
from asyncllm.sampling_params import RequestOutputKind

_Out = TypeVar("_Out", RequestOutput, EmbeddingRequestOutput)


class RequestOutputCollector(Generic[_Out]):
    def __init__(self, kind: RequestOutputKind) -> None:
        self.delta = kind == RequestOutputKind.DELTA
        self.output: _Out | None = None
        self.error: BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, output: _Out) -> None:
        if self.output is None or not self.delta:
            self.output = output
        else:  # only completions stream deltas
            _merge_delta(cast(RequestOutput, self.output), cast(RequestOutput, output))
        self.ready.set()

    def put_error(self, error: BaseException) -> None:
        self.error = error
        self.ready.set()

    async def get(self) -> _Out:
        """The pending output; raises the error the request failed with."""
        while self.output is None:
            if self.error is not None:
                raise self.error
            await self.ready.wait()
            self.ready.clear()
        output, self.output = self.output, None
        return output

    def get_nowait(self) -> _Out | None:
        if self.error is not None and self.output is None:
            raise self.error
        output, self.output = self.output, None
        return output


def _merge_delta(into: RequestOutput, new: RequestOutput) -> None:
    """Fold a later DELTA output into an earlier one not yet consumed."""
    by_index = {c.index: c for c in into.outputs}
    for comp in new.outputs:
        old = by_index.get(comp.index)
        if old is None:
            into.outputs.append(comp)
            continue
        old.text += comp.text
        old.token_ids.extend(comp.token_ids)
        if comp.logprobs is not None:
            old.logprobs = (old.logprobs or []) + comp.logprobs
        old.cumulative_logprob = comp.cumulative_logprob
        old.finish_reason = comp.finish_reason
        old.stop_reason = comp.stop_reason
    into.finished = new.finished
    if new.prompt_logprobs is not None:
        into.prompt_logprobs = new.prompt_logprobs
    if new.num_cached_tokens is not None:
        into.num_cached_tokens = new.num_cached_tokens
