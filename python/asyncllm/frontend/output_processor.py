"""Turns engine-core outputs into `RequestOutput`s: accumulates tokens and
logprobs per request, detokenizes, finds stop strings, and joins the children of
an `n > 1` request.

One loop per step over that step's outputs, around one call of the Rust
detokenizer for all of them (which runs without the GIL); this is the front end's
hot path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncllm._core import Detokenizer
from asyncllm.engine.messages import EngineCoreOutput, Logprobs
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.outputs import CompletionOutput, Logprob, RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


@dataclass
class ParentState:
    """A user request; with `n > 1` it owns n child requests in the core."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: list[ChildState] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


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
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer.path)
        self.children: dict[int, ChildState] = {}

    def add_request(self, parent: ParentState, core_ids: list[int]) -> None:
        params = parent.params
        wants_logprobs = params.logprobs is not None
        for index, core_id in enumerate(core_ids):
            child = ChildState(core_id, index, parent)
            if wants_logprobs:
                child.logprobs = []
                child.cumulative_logprob = 0.0
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

    def has_unfinished(self) -> bool:
        return bool(self.children)

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[int]]:
        """Absorb one step's outputs. Returns the RequestOutputs due now and the core
        ids of requests a stop string just finished, which the core must abort."""
        children = self.children
        live = [(children[o.request_id], o) for o in outputs if o.request_id in children]
        if not live:
            return [], []
        detok_results = self.detokenizer.step(
            [c.core_id for c, _ in live],
            [o.new_token_ids for _, o in live],
            [o.finish_reason is not None for _, o in live],
        )
        due: dict[str, ParentState] = {}
        stopped: list[int] = []
        for (child, out), (text, stop_index, num_kept, _) in zip(live, detok_results, strict=True):
            parent = child.parent
            new_ids = out.new_token_ids
            if stop_index is not None:
                new_ids = new_ids[:num_kept]
            child.token_ids.extend(new_ids)
            child.text += text
            if out.logprobs is not None and child.logprobs is not None:
                self._append_logprobs(child, out.logprobs, len(new_ids))
            if out.prompt_logprobs is not None:
                parent.prompt_logprobs = self._prompt_logprobs(out.prompt_logprobs)
            if out.num_cached_tokens:
                parent.num_cached_tokens = out.num_cached_tokens
            if stop_index is not None:
                child.finish_reason = "stop"
                child.stop_reason = parent.params.stop_strings[stop_index]
                self.detokenizer.remove(child.core_id)
                if out.finish_reason is None:
                    stopped.append(child.core_id)
                del children[child.core_id]
            elif out.finish_reason is not None:
                child.finish_reason = out.finish_reason
                child.stop_reason = out.stop_reason
                del children[child.core_id]
            if parent.params.output_kind != RequestOutputKind.FINAL_ONLY or parent.finished:
                due[parent.request_id] = parent
        return [self._make_output(p) for p in due.values()], stopped

    def _make_output(self, parent: ParentState) -> RequestOutput:
        params = parent.params
        delta = params.output_kind == RequestOutputKind.DELTA
        finished = parent.finished
        completions = []
        for child in parent.children:
            text = child.text
            tokens, logprobs = child.token_ids, child.logprobs
            if delta:
                new_text = text[child.num_sent_chars :]
                tokens = tokens[child.num_sent_tokens :]
                if logprobs is not None:
                    logprobs = logprobs[child.num_sent_tokens :]
            else:
                new_text = text
            child.num_sent_chars = len(text)
            child.num_sent_tokens = len(child.token_ids)
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=new_text,
                    token_ids=list(tokens),
                    cumulative_logprob=child.cumulative_logprob,
                    logprobs=list(logprobs) if logprobs is not None else None,
                    finish_reason=child.finish_reason,
                    stop_reason=child.stop_reason,
                )
            )
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=completions,
            finished=finished,
            prompt_logprobs=parent.prompt_logprobs,
            num_cached_tokens=parent.num_cached_tokens,
        )

    def _append_logprobs(self, child: ChildState, lp: Logprobs, num: int) -> None:
        assert child.logprobs is not None
        for ids, values, rank in zip(
            lp.token_ids[:num], lp.logprobs[:num], lp.ranks[:num], strict=True
        ):
            child.logprobs.append(self._logprob_dict(ids, values, rank))
            child.cumulative_logprob = (child.cumulative_logprob or 0.0) + values[0]

    def _prompt_logprobs(self, lp: Logprobs) -> list[dict[int, Logprob] | None]:
        out: list[dict[int, Logprob] | None] = [None]
        for ids, values, rank in zip(lp.token_ids, lp.logprobs, lp.ranks, strict=True):
            out.append(self._logprob_dict(ids, values, rank))
        return out

    def _logprob_dict(self, ids: list[int], values: list[float], rank: int) -> dict[int, Logprob]:
        decode = self.tokenizer.decode
        entry = {ids[0]: Logprob(values[0], rank, decode([ids[0]], False))}
        for r, (tid, value) in enumerate(zip(ids[1:], values[1:], strict=True), start=1):
            if tid not in entry:
                entry[tid] = Logprob(value, r, decode([tid], False))
        return entry
