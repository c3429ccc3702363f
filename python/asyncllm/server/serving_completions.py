"""`POST /v1/completions`: one or several prompts (text or token ids), `n` choices
each, streamed as SSE or answered whole, with legacy `logprobs` and `echo`.

`max_tokens: 0` with `echo` (how scoring clients ask for prompt logprobs only)
runs the request for one token, which the core needs to compute the prompt's
logprobs, and drops that token: the choice is the echoed prompt, no completion
tokens, finish_reason "length".
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import CompletionOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.limits import Ticket
from asyncllm.server.logprobs import LegacyLogprobs
from asyncllm.server.protocol import APIError, CompletionRequest, bad_request
from asyncllm.server.serving_base import (
    ServingBase,
    gather_first_error,
    join_body,
    merge_streams,
    off_loop,
    random_id,
    sum_cached_tokens,
    usage,
)
from asyncllm.server.sse import DONE, ChunkRenderer, SSEResponse, error_event, run_until_disconnect

JSON = "application/json"


class _Prompt:
    """One prompt of a request, tokenized, with its sampling parameters."""

    __slots__ = ("index", "text", "ids", "params", "lora", "request_id", "echo", "pieces")

    def __init__(self, index: int, text: str | None, ids: list[int]) -> None:
        self.index = index
        self.text = text
        self.ids = ids
        self.params: SamplingParams | None = None
        self.lora: LoRARequest | None = None  # the adapter the request's model names
        self.request_id = ""
        self.echo = ""  # the echoed text (echo only)
        self.pieces: list[str] = []  # each prompt token's share of `echo`


class CompletionServing(ServingBase):
    async def create(self, req: CompletionRequest, receive: Any) -> Response:
        lora = self.check_model(req.model)
        self.limits.check_sampling(req)
        prompts = await self._prompts(req.prompt)
        prompt_only = req.max_tokens == 0
        if prompt_only and not req.echo:
            raise bad_request(
                "max_tokens=0 is only valid with echo=true (the prompt's logprobs alone)",
                "max_tokens",
            )
        wanted = 1 if prompt_only else req.max_tokens
        base_id = random_id("cmpl")
        max_tokens = []
        for p in prompts:
            max_tokens.append(self.max_tokens_for(len(p.ids), wanted, "max_tokens", "prompt"))
            p.params = req.sampling_params(max_tokens[-1])
            p.request_id = base_id if len(prompts) == 1 else f"{base_id}-{p.index}"
            p.lora = lora
        params = prompts[0].params
        assert params is not None
        await self.check_params(params)
        self.limits.check_response_size(
            [len(p.ids) for p in prompts],
            [0 if prompt_only else m for m in max_tokens],
            params.n,
            echo=req.echo,
            logprobs=req.logprobs,
            chat=False,
            stream=req.stream,
        )
        if req.echo:
            for p in prompts:
                p.echo, p.pieces = await off_loop(self._echo, p)
        self.check_engine()
        ticket = self.admission.admit(len(prompts) * params.n)
        created = int(time.time())
        if req.stream:
            chunks = self._stream(req, prompts, base_id, created, prompt_only)
            return SSEResponse(chunks, on_close=ticket.release)
        return await self._respond(req, prompts, base_id, created, prompt_only, receive, ticket)

    async def _respond(
        self,
        req: CompletionRequest,
        prompts: list[_Prompt],
        base_id: str,
        created: int,
        prompt_only: bool,
        receive: Any,
        ticket: Ticket,
    ) -> Response:
        try:
            work = self._complete(req, prompts, base_id, created, prompt_only)
            body = await run_until_disconnect(receive, work)
        finally:
            ticket.release()
        if body is None:
            return Response(status_code=499)
        return Response(body, media_type=JSON)

    async def _prompts(self, prompt: Any) -> list[_Prompt]:
        if isinstance(prompt, str):
            items: list[Any] = [prompt]
        elif prompt and all(isinstance(t, int) for t in prompt):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise bad_request("prompt must not be empty", "prompt")
        self.limits.check_prompts(items)
        texts = [item for item in items if isinstance(item, str)]
        encoded = iter(await off_loop(self.tokenizer.encode_batch, texts) if texts else ())
        out = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                out.append(_Prompt(i, item, next(encoded)))
                continue
            if not item:
                raise bad_request("a token-id prompt must not be empty", "prompt")
            self.check_prompt_ids(item, "prompt")
            out.append(_Prompt(i, None, list(item)))
        if not any(p.ids for p in out):
            raise bad_request("prompt must not be empty", "prompt")
        return out

    def _echo(self, p: _Prompt) -> tuple[str, list[str]]:
        """The echoed prompt and its tokens' shares of it. A text prompt echoes as
        given, unless its tokens' text cannot be fitted to it; a token-id prompt
        as its tokens' text, special tokens included. Either way text, tokens and
        text_offset describe the same string."""
        if p.text is not None:
            pieces = self.token_text.pieces_of_text(p.ids, p.text)
            if pieces is not None:
                return p.text, pieces
        pieces = self.token_text.pieces(p.ids)
        return "".join(pieces), pieces

    # -- streamed -------------------------------------------------------------------------

    async def _stream(
        self,
        req: CompletionRequest,
        prompts: list[_Prompt],
        base_id: str,
        created: int,
        prompt_only: bool,
    ) -> AsyncIterator[bytes]:
        renderer = ChunkRenderer(
            base_id, created, self.echoed_model(req.model), False, req.include_usage
        )
        counts = [0, 0]  # prompt tokens, completion tokens
        cached: list[int | None] = [None] * len(prompts)
        streams = [
            self._stream_prompt(req, p, renderer, counts, cached, prompt_only) for p in prompts
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
        prompt_only: bool,
    ) -> AsyncIterator[bytes]:
        assert p.params is not None
        n = p.params.n
        base = p.index * n
        pending_echo = [req.echo] * n
        done = [False] * n
        want_lp = req.logprobs is not None
        lps = LegacyLogprobs(self.token_text, req.logprobs or 0, p.params.skip_special_tokens)
        offsets = [0] * n
        decoders = [self.token_text.piece_decoder(p.params.skip_special_tokens) for _ in range(n)]
        timer = self.metrics.start(len(p.ids))
        counts[0] += len(p.ids)
        async for out in self.generate(p.ids, p.text, p.params, p.request_id, timer, p.lora):
            if out.num_cached_tokens is not None:
                cached[p.index] = out.num_cached_tokens
            for c in out.outputs:
                i = c.index
                if prompt_only:
                    c = _dropped(c)
                counts[1] += len(c.token_ids)
                if done[i]:
                    continue
                text = c.text
                lp = b"null"
                if pending_echo[i]:
                    pending_echo[i] = False
                    offsets[i] = len(p.echo)
                    if want_lp:  # the prompt's rows: large, so built off the loop
                        lp_dict = await off_loop(lps.prompt, p.ids, p.pieces, out.prompt_logprobs)
                        new = lps.sampled(c, offsets[i], decoders[i])
                        offsets[i] = lps.end_offset(new, offsets[i])
                        lps.extend(lp_dict, new)
                        lp = await off_loop(_dumps, lp_dict)
                    text = p.echo + text
                elif want_lp and c.token_ids:
                    new = lps.sampled(c, offsets[i], decoders[i])
                    offsets[i] = lps.end_offset(new, offsets[i])
                    lp = json.dumps(new).encode()
                if text or c.finish_reason is not None or lp != b"null":
                    yield renderer.chunk(base + i, text, c.finish_reason, lp)
                if c.finish_reason is not None:
                    done[i] = True

    # -- whole ----------------------------------------------------------------------------

    async def _complete(
        self,
        req: CompletionRequest,
        prompts: list[_Prompt],
        base_id: str,
        created: int,
        prompt_only: bool,
    ) -> bytes:
        results = await gather_first_error([self._collect_prompt(p) for p in prompts])
        return await off_loop(self._build, req, prompts, results, base_id, created, prompt_only)

    async def _collect_prompt(self, p: _Prompt) -> tuple[list[CompletionOutput], Any, int | None]:
        assert p.params is not None
        timer = self.metrics.start(len(p.ids))
        return await self.collect(
            self.generate(p.ids, p.text, p.params, p.request_id, timer, p.lora), p.params.n
        )

    def _build(
        self,
        req: CompletionRequest,
        prompts: list[_Prompt],
        results: list[tuple[list[CompletionOutput], Any, int | None]],
        base_id: str,
        created: int,
        prompt_only: bool,
    ) -> bytes:
        """The whole response body; runs on a worker thread. Each choice is
        serialised alone, so the GIL is handed back between choices."""
        choices: list[bytes] = []
        completion_tokens = 0
        for p, (outputs, prompt_logprobs, _) in zip(prompts, results, strict=True):
            assert p.params is not None
            lps = LegacyLogprobs(self.token_text, req.logprobs or 0, p.params.skip_special_tokens)
            echo_lp = None
            if req.echo and req.logprobs is not None:
                echo_lp = lps.prompt(p.ids, p.pieces, prompt_logprobs)
            for c in outputs:
                if prompt_only:
                    c = _dropped(c)
                completion_tokens += len(c.token_ids)
                lp: dict[str, Any] | None = None
                if req.logprobs is not None:
                    lp = lps.empty() if echo_lp is None else lps.copy(echo_lp)
                    decoder = self.token_text.piece_decoder(p.params.skip_special_tokens)
                    lps.extend(lp, lps.sampled(c, len(p.echo), decoder))
                choice = {
                    "index": p.index * p.params.n + c.index,
                    "text": p.echo + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                choices.append(json.dumps(choice, separators=(",", ":")).encode())
        head = {
            "id": base_id,
            "object": "text_completion",
            "created": created,
            "model": self.echoed_model(req.model),
            "usage": usage(
                sum(len(p.ids) for p in prompts),
                completion_tokens,
                sum_cached_tokens([num_cached for _, _, num_cached in results]),
            ),
            "system_fingerprint": None,
        }
        return join_body(head, choices)


def _dumps(data: Any) -> bytes:
    return json.dumps(data).encode()


def _dropped(c: CompletionOutput) -> CompletionOutput:
    """A choice of a `max_tokens: 0` request without the token run to get the
    prompt's logprobs."""
    return CompletionOutput(
        c.index, "", [], None, [], _PROMPT_ONLY_FINISH.get(c.finish_reason), None
    )


# the dropped token may have been EOS; the choice still ended for max_tokens
_PROMPT_ONLY_FINISH: dict[str | None, str | None] = {
    "stop": "length",
    "length": "length",
    "abort": "abort",
    "error": "error",
}
