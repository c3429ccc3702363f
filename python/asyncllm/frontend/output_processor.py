"""Turns engine-core outputs into `RequestOutput`s: accumulates tokens and
logprobs per request, detokenizes, finds stop strings, and joins the children of
an `n > 1` request.

One loop per step over that step's outputs, around one call of the Rust
detokenizer for all of them (which runs without the GIL); this is the front end's
hot path. Embedding requests never enter it: `pooling_outputs` finishes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from asyncllm._core import Detokenizer, Logprobs, OutputBatch
from asyncllm.frontend.pooling_outputs import EmbeddingState, PoolingOutputs
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.outputs import CompletionOutput, EmbeddingRequestOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.tracing import Tracer, now_ns

# An output batch's finish reasons, stop reasons and errors, one entry per row.
_Ends = tuple[list[Any], list[int | None], list[str | None]]
# What a step gives a request: a completion's output, or an embedding.
AnyRequestOutput = RequestOutput | EmbeddingRequestOutput


@dataclass
class ParentState:
    """A user request; with `n > 1` it owns n child requests in the core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error: str | None = None  # set when the core rejected a child
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache
    num_finished: int = 0  # children with a finish reason (counted by `_forget`)

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.children)


@dataclass
class ChildState:
    core_id: int  # the request's id in the core and on the wire; also its detokenizer id
    index: int
    parent: ParentState
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, tracer: Tracer | None = None) -> None:
        self.tokenizer = tokenizer
        self.tracer = tracer  # spans per step batch (asyncllm.tracing); None: off
        # Each token's text for logprob entries, decoded once per token id: rows of
        # top-N repeat the same few thousand ids, and a decode per entry (n=50 x
        # logprobs=20 x 400 tokens is 400k decodes) stalled the event loop for seconds.
        self._token_text: dict[int, str] = {}
        self.detokenizer = Detokenizer(tokenizer.path)
        self.children: dict[int, ChildState] = {}
        self._num_with_logprobs = 0  # live children asking for (prompt) logprobs
        self.pooling = PoolingOutputs()  # the open embedding requests

    def add_request(self, parent: ParentState, core_ids: list[int]) -> None:
        params = parent.params
        wants_logprobs = params.logprobs is not None
        for index, core_id in enumerate(core_ids):
            child = ChildState(core_id, index, parent)
            if wants_logprobs:
                child.logprobs = []
                child.cumulative_logprob = 0.0
            if wants_logprobs or params.prompt_logprobs is not None:
                self._num_with_logprobs += 1
            self.detokenizer.add_request(
                core_id,
                parent.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
                min_tokens=params.min_tokens,
            )
            parent.children.append(child)
            self.children[core_id] = child

    def add_embedding(self, state: EmbeddingState) -> None:
        self.pooling.add(state)

    def has_unfinished(self) -> bool:
        return bool(self.children) or bool(self.pooling.requests)

    def process_outputs(self, batch: OutputBatch) -> tuple[list[AnyRequestOutput], list[int]]:
        """Absorb one step's outputs. Returns the outputs due now and the core ids
        of requests a stop string just finished, which the core must abort."""
        if self.pooling.requests:
            embedded = self.pooling.process(batch)
            outputs, stopped = self._process_completions(batch)
            return [*embedded, *outputs], stopped
        return self._process_completions(batch)

    def _process_completions(self, batch: OutputBatch) -> tuple[list[AnyRequestOutput], list[int]]:
        """`process_outputs` for the batch's completions."""
        tracer = self.tracer
        if tracer is not None:
            t0 = now_ns()
        children = self.children
        columns = self._columns(batch)
        if columns is None:
            return [], []
        idx, wire_ids, new_tokens, finished_ids = columns
        if tracer is not None:
            t1 = now_ns()
        # incremental detokenizing and the stop-string search, in one Rust call
        result = self.detokenizer.step(
            wire_ids, new_tokens, [w for w in wire_ids if w in finished_ids]
        )
        if tracer is not None:
            t2 = now_ns()
        texts = result.texts
        stops = {pos: (stop, kept) for pos, stop, kept in result.stops} if result.stops else {}
        has_logprobs = self._num_with_logprobs > 0
        ends: _Ends | None = None
        due: dict[str, ParentState] = {}
        stopped: list[int] = []
        for j, i in enumerate(idx):
            wire_id = wire_ids[j]
            child = children[wire_id]
            parent = child.parent
            new_ids = new_tokens[j]
            stop = stops.get(j) if stops else None
            if stop is not None:
                new_ids = new_ids[: stop[1]]
            child.token_ids.extend(new_ids)
            child.text += texts[j]
            if has_logprobs:
                lp = batch.logprobs(i)
                if lp is not None and child.logprobs is not None:
                    self._append_logprobs(child, lp, len(new_ids))
                plp = batch.prompt_logprobs(i)
                if plp is not None:
                    parent.prompt_logprobs = self._prompt_logprobs(plp)
            if stop is not None:
                self._finish_at_stop_string(child, stop[0])
                if wire_id not in finished_ids:
                    stopped.append(wire_id)
            elif wire_id in finished_ids:
                if ends is None:  # read once per batch, and only when one ended
                    ends = batch.finish_reasons, batch.stop_reasons, batch.errors
                self._finish_in_core(child, ends, i)
            if parent.params.output_kind != RequestOutputKind.FINAL_ONLY or parent.finished:
                due[parent.request_id] = parent
        if tracer is None:
            return [self._make_output(p) for p in due.values()], stopped
        t3 = now_ns()
        outputs: list[AnyRequestOutput] = [self._make_output(p) for p in due.values()]
        n = len(wire_ids)
        tracer.complete("columns", t0, t1, {"outputs": n})
        tracer.complete("detokenize", t1, t2, {"outputs": n, "stops": len(stops)})
        tracer.complete("update_requests", t2, t3, {"outputs": n, "stopped": len(stopped)})
        tracer.complete("make_outputs", t3, now_ns(), {"requests": len(outputs)})
        return outputs, stopped

    def _columns(
        self, batch: OutputBatch
    ) -> tuple[Sequence[int], list[int], list[list[int]], set[int]] | None:
        """The batch's rows of requests still open here (positions in the batch,
        wire ids, new tokens) and the wire ids the core finished; None when no
        row is left."""
        wire_ids = batch.wire_ids
        if not wire_ids:
            return None
        cached = batch.num_cached_tokens  # each request's first output only: rare
        if cached:
            self._note_cached(wire_ids, cached)
        new_tokens = batch.all_new_token_ids()
        finished_idx = batch.finished_indices
        finished_ids = {wire_ids[i] for i in finished_idx} if finished_idx else set()
        idx: Sequence[int] = range(len(wire_ids))
        children = self.children
        if not children.keys() >= set(wire_ids):  # some ended in the front end already
            idx = [i for i, w in enumerate(wire_ids) if w in children]
            if not idx:
                return None
            wire_ids = [wire_ids[i] for i in idx]
            new_tokens = [new_tokens[i] for i in idx]
        return idx, wire_ids, new_tokens, finished_ids

    def _finish_at_stop_string(self, child: ChildState, stop_index: int) -> None:
        """The detokenizer found the request's stop string `stop_index`."""
        child.finish_reason = "stop"
        child.stop_reason = child.parent.params.stop_strings[stop_index]
        self.detokenizer.remove(child.core_id)
        self._forget(child)

    def _finish_in_core(self, child: ChildState, ends: _Ends, i: int) -> None:
        """The core finished the request in row `i` of the batch (a stop token,
        EOS, a length limit, or an error); `ends` are the batch's finish reasons,
        stop reasons and errors."""
        finish_reasons, stop_reasons, errors = ends
        child.finish_reason = finish_reasons[i]
        child.stop_reason = stop_reasons[i]
        if child.finish_reason == "error":
            child.parent.error = errors[i] or "the engine core rejected the request"
        self._forget(child)

    def abort(self, core_ids: list[int]) -> list[AnyRequestOutput]:
        """Finish children (or embedding requests) the front end gave up on (the
        caller aborts them in the core). Returns the final outputs of the requests
        this finishes."""
        embedded: list[AnyRequestOutput] = []
        if self.pooling.requests:
            embedded.extend(self.pooling.abort(core_ids))
        due: dict[str, ParentState] = {}
        for core_id in core_ids:
            child = self.children.get(core_id)
            if child is None:
                continue
            child.finish_reason = "abort"
            self.detokenizer.remove(core_id)
            self._forget(child)
            if child.parent.finished:
                due[child.parent.request_id] = child.parent
        return [*embedded, *(self._make_output(p) for p in due.values())]

    def _note_cached(self, wire_ids: list[int], cached: dict[int, int]) -> None:
        """Record the prefix-cache hits of requests on their first output. With
        `n > 1` the first child's count stands for the request."""
        for i, num in cached.items():
            child = self.children.get(wire_ids[i])
            if child is not None and (child.parent.num_cached_tokens is None or not child.index):
                child.parent.num_cached_tokens = num

    def _forget(self, child: ChildState) -> None:
        """Called once per child, right after its finish reason was set."""
        del self.children[child.core_id]
        child.parent.num_finished += 1
        if child.logprobs is not None or child.parent.params.prompt_logprobs is not None:
            self._num_with_logprobs -= 1

    def _make_output(self, parent: ParentState) -> RequestOutput:
        # Runs once per request per step: positional constructors, and a delta's
        # slices are new lists already (no second copy).
        delta = parent.params.output_kind == RequestOutputKind.DELTA
        completions = []
        for child in parent.children:
            text, tokens, logprobs = child.text, child.token_ids, child.logprobs
            num_tokens = len(tokens)
            if delta:
                new_text = text[child.num_sent_chars :]
                new_tokens = tokens[child.num_sent_tokens :]
                if logprobs is not None:
                    logprobs = logprobs[child.num_sent_tokens :]
            else:
                new_text, new_tokens = text, list(tokens)
                if logprobs is not None:
                    logprobs = list(logprobs)
            child.num_sent_chars = len(text)
            child.num_sent_tokens = num_tokens
            completions.append(
                CompletionOutput(
                    child.index,
                    new_text,
                    new_tokens,
                    child.cumulative_logprob,
                    logprobs,
                    child.finish_reason,
                    child.stop_reason,
                )
            )
        return RequestOutput(
            parent.request_id,
            parent.prompt,
            parent.prompt_token_ids,
            completions,
            parent.finished,
            parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _append_logprobs(self, child: ChildState, lp: Logprobs, num: int) -> None:
        assert child.logprobs is not None
        for entry in self._logprob_rows(lp, num):
            child.logprobs.append(entry)
            sampled = next(iter(entry.values()))
            child.cumulative_logprob = (child.cumulative_logprob or 0.0) + sampled.logprob

    def _prompt_logprobs(self, lp: Logprobs) -> list[dict[int, Logprob] | None]:
        return [None, *self._logprob_rows(lp, lp.num_positions)]

    def _logprob_rows(self, lp: Logprobs, num: int) -> list[dict[int, Logprob]]:
        """The first `num` positions of a flat Logprobs as one dict per position:
        the sampled (or actual) token first, with its rank, then the top-N."""
        width = lp.width
        ids, values, ranks = lp.token_ids, lp.logprobs, lp.ranks
        text = self._token_text
        decode = self.tokenizer.decode
        rows = []
        for k in range(min(num, lp.num_positions)):
            base = k * width
            entry: dict[int, Logprob] = {}
            for r in range(width):
                tid = ids[base + r]
                if tid in entry:
                    continue
                piece = text.get(tid)
                if piece is None:
                    piece = text[tid] = decode([tid], False)
                entry[tid] = Logprob(values[base + r], ranks[k] if r == 0 else r, piece)
            rows.append(entry)
        return rows
