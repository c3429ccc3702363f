"""`POST /v1/completions`: one or several prompts (text or token ids), `n` choices
each, streamed as SSE or answered whole, with legacy `logprobs` and `echo`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from asyncllm.outputs import CompletionOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.protocol import APIError, CompletionRequest, bad_request
from asyncllm.server.serving_base import (
    ServingBase,
    merge_streams,
    note_cached_tokens,
    random_id,
    sum_cached_tokens,
    token_str,
    top_entries,
    usage,
)
from asyncllm.server.sse import DONE, ChunkRenderer, SSEResponse, error_event, run_until_disconnect

JSON = "application/json"


class _Prompt:
    """One prompt of a request, tokenized, with its sampling parameters."""

    __slots__ = ("index", "text", "ids", "params", "request_id")

    def __init__(self, index: int, text: str | None, ids: list[int]) -> None:
        self.index = index
        self.text = text
        self.ids = ids
        self.params: SamplingParams | None = None
        self.request_id = ""


class CompletionServing(ServingBase):
    async def create(self, req: CompletionRequest, receive: Any) -> Response:
        self.check_model(req.model)
        prompts = self._prompts(req.prompt)
        base_id = random_id("cmpl")
        for p in prompts:
            max_tokens = self.max_tokens_for(len(p.ids), req.max_tokens, "max_tokens", "prompt")
            p.params = req.sampling_params(max_tokens)
            p.request_id = base_id if len(prompts) == 1 else f"{base_id}-{p.index}"
        self.check_engine()
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, prompts, base_id, created))
        body = await run_until_disconnect(receive, self._complete(req, prompts, base_id, created))
        if body is None:
            return Response(status_code=499)
        return Response(body, media_type=JSON)

    def _prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        vocab = self.engine.input_processor.vocab_size
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                ids = self.tokenizer.encode(item)
                out.append(_Prompt(i, item, ids))
                continue
            if not item:
                raise bad_request("a token-id prompt must not be empty", "prompt")
            for t in item:
                if not 0 <= t < vocab:
                    raise bad_request(f"prompt token id {t} is outside [0, {vocab})", "prompt")
            out.append(_Prompt(i, None, list(item)))
        if not any(p.ids for p in out):
            raise bad_request("prompt must not be empty", "prompt")
        return out

    def _echo_text(self, p: _Prompt) -> str:
        return p.text if p.text is not None else self.tokenizer.decode(p.ids)

    # -- streamed -------------------------------------------------------------------------

    async def _stream(
        self, req: CompletionRequest, prompts: list[_Prompt], base_id: str, created: int
    ) -> AsyncIterator[bytes]:
        renderer = ChunkRenderer(base_id, created, self.model_name, False, req.include_usage)
        counts = [0, 0]  # prompt tokens, completion tokens
        cached: list[list[int | None]] = [[None] for _ in prompts]
        streams = [
            self._stream_prompt(req, p, renderer, counts, cell)
            for p, cell in zip(prompts, cached, strict=True)
        ]
        try:
            async for chunk in merge_streams(streams):
                yield chunk
        except APIError as exc:
            yield error_event(exc.message, exc.status)
        else:
            if req.include_usage:
                yield renderer.usage_chunk(usage(counts[0], counts[1], sum_cached_tokens(cached)))
        yield DONE

    async def _stream_prompt(
        self,
        req: CompletionRequest,
        p: _Prompt,
        renderer: ChunkRenderer,
        counts: list[int],
        cached: list[int | None],
    ) -> AsyncIterator[bytes]:
        assert p.params is not None
        n = p.params.n
        base = p.index * n
        echo: list[str | None] | None = [self._echo_text(p)] * n if req.echo else None
        done = [False] * n
        want_lp = req.logprobs is not None
        num_top = req.logprobs or 0
        offsets = [0] * n
        timer = self.metrics.start(len(p.ids))
        counts[0] += len(p.ids)
        outputs = self.generate(p.ids, p.text, p.params, p.request_id, timer)
        async for out in note_cached_tokens(outputs, cached):
            for c in out.outputs:
                i = c.index
                counts[1] += len(c.token_ids)
                if done[i]:
                    continue
                text = c.text
                lp = b"null"
                prefix = echo[i] if echo is not None else None
                if prefix is not None:
                    echo[i] = None  # type: ignore[index]
                    if want_lp:
                        lp_dict = self._echo_logprobs(p, out.prompt_logprobs, num_top)
                        _extend(lp_dict, self._logprobs(c, num_top, len(prefix)))
                        lp = json.dumps(lp_dict).encode()
                    text = prefix + text
                    offsets[i] = len(prefix)
                elif want_lp and c.token_ids:
                    lp = json.dumps(self._logprobs(c, num_top, offsets[i])).encode()
                if want_lp:
                    offsets[i] += len(c.text)
                if text or c.finish_reason is not None or lp != b"null":
                    yield renderer.chunk(base + i, text, c.finish_reason, lp)
                if c.finish_reason is not None:
                    done[i] = True

    # -- whole ----------------------------------------------------------------------------

    async def _complete(
        self, req: CompletionRequest, prompts: list[_Prompt], base_id: str, created: int
    ) -> bytes:
        cached: list[list[int | None]] = [[None] for _ in prompts]
        if len(prompts) == 1:
            results = [await self._complete_prompt(req, prompts[0], cached[0])]
        else:
            try:
                async with asyncio.TaskGroup() as group:
                    tasks = [
                        group.create_task(self._complete_prompt(req, p, cell))
                        for p, cell in zip(prompts, cached, strict=True)
                    ]
            except ExceptionGroup as group_error:  # the first failure answers the request
                raise group_error.exceptions[0] from None
            results = [task.result() for task in tasks]
        choices: list[dict[str, Any]] = []
        completion_tokens = 0
        for prompt_choices, num in results:
            choices.extend(prompt_choices)
            completion_tokens += num
        body = {
            "id": base_id,
            "object": "text_completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(
                sum(len(p.ids) for p in prompts), completion_tokens, sum_cached_tokens(cached)
            ),
            "system_fingerprint": None,
        }
        return json.dumps(body, separators=(",", ":")).encode()

    async def _complete_prompt(
        self, req: CompletionRequest, p: _Prompt, cached: list[int | None]
    ) -> tuple[list[dict[str, Any]], int]:
        assert p.params is not None
        n = p.params.n
        timer = self.metrics.start(len(p.ids))
        outputs, prompt_logprobs = await self.collect(
            note_cached_tokens(self.generate(p.ids, p.text, p.params, p.request_id, timer), cached),
            n,
        )
        choices = []
        num_top = req.logprobs or 0
        for c in outputs:
            lp: dict[str, Any] | None = None
            prefix = self._echo_text(p) if req.echo else ""
            if req.logprobs is not None:
                lp = self._echo_logprobs(p, prompt_logprobs, num_top) if req.echo else _empty()
                _extend(lp, self._logprobs(c, num_top, len(prefix)))
            choices.append(
                {
                    "index": p.index * n + c.index,
                    "text": prefix + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return choices, sum(len(c.token_ids) for c in outputs)

    # -- legacy logprobs ----------------------------------------------------------------

    def _logprobs(self, c: CompletionOutput, num_top: int, offset: int) -> dict[str, Any]:
        """OpenAI's legacy shape for the tokens of `c`: tokens, token_logprobs,
        top_logprobs (the `num_top` most likely per position) and text_offset."""
        lp = _empty()
        for token_id, entry in zip(c.token_ids, c.logprobs or (), strict=False):
            chosen = entry.get(token_id)
            token = token_str(token_id, chosen) if chosen else str(token_id)
            lp["tokens"].append(token)
            lp["token_logprobs"].append(chosen.logprob if chosen else None)
            lp["top_logprobs"].append(
                {token_str(t, v): v.logprob for t, v in top_entries(entry, num_top)}
            )
            lp["text_offset"].append(offset)
            offset += len(token)
        return lp

    def _echo_logprobs(self, p: _Prompt, prompt_lps: Any, num_top: int) -> dict[str, Any]:
        """The prompt's tokens in the legacy shape (the first one has no logprob)."""
        lp = _empty()
        offset = 0
        for k, token_id in enumerate(p.ids):
            entry = prompt_lps[k] if prompt_lps is not None and k < len(prompt_lps) else None
            chosen = entry.get(token_id) if entry else None
            token = self.tokenizer.decode([token_id], False)
            lp["tokens"].append(token)
            lp["token_logprobs"].append(chosen.logprob if chosen else None)
            lp["top_logprobs"].append(
                {token_str(t, v): v.logprob for t, v in top_entries(entry, num_top)}
                if entry
                else None
            )
            lp["text_offset"].append(offset)
            offset += len(token)
        return lp


def _empty() -> dict[str, Any]:
    return {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def _extend(into: dict[str, Any], more: dict[str, Any]) -> None:
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        into[key].extend(more[key])
