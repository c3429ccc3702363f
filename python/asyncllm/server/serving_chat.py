"""`POST /v1/chat/completions`: messages rendered through the model's chat
template, `n` choices, streamed as SSE or answered whole, with chat `logprobs`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.outputs import CompletionOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.chat_template import ChatTemplate, ChatTemplateError
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.protocol import APIError, ChatCompletionRequest, ChatMessage, bad_request
from asyncllm.server.serving_base import (
    ServerConfig,
    ServingBase,
    note_cached_tokens,
    random_id,
    token_str,
    top_entries,
    usage,
)
from asyncllm.server.sse import DONE, ChunkRenderer, SSEResponse, error_event, run_until_disconnect

JSON = "application/json"


class ChatServing(ServingBase):
    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        metrics: ServerMetrics,
        template: ChatTemplate | None,
    ) -> None:
        super().__init__(engine, config, metrics)
        self.template = template

    def render_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> tuple[str, list[int]]:
        """The prompt text and ids. The template writes the special tokens itself
        (BOS included), so the tokenizer adds none."""
        if self.template is None:
            raise bad_request(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or use /v1/completions",
                "messages",
            )
        try:
            text = self.template.render(
                [m.template_dict() for m in messages], add_generation_prompt, extra
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    async def create(self, req: ChatCompletionRequest, receive: Any) -> Response:
        self.check_model(req.model)
        text, ids = self.render_prompt(
            req.messages, req.add_generation_prompt, req.chat_template_kwargs
        )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(len(ids), req.requested_max_tokens, param, "messages")
        params = req.sampling_params(max_tokens)
        self.check_engine()
        request_id = random_id("chatcmpl")
        created = int(time.time())
        if req.stream:
            return SSEResponse(self._stream(req, text, ids, params, request_id, created))
        work = self._complete(req, text, ids, params, request_id, created)
        body = await run_until_disconnect(receive, work)
        if body is None:
            return Response(status_code=499)
        return Response(body, media_type=JSON)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        text: str,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        created: int,
    ) -> AsyncIterator[bytes]:
        renderer = ChunkRenderer(request_id, created, self.model_name, True, req.include_usage)
        n = params.n
        for i in range(n):
            yield renderer.role_chunk(i)
        done = [False] * n
        num_top = req.top_logprobs or 0
        num_tokens = 0
        timer = self.metrics.start(len(ids))
        cached: list[int | None] = [None]
        try:
            outputs = self.generate(ids, text, params, request_id, timer)
            async for out in note_cached_tokens(outputs, cached):
                for c in out.outputs:
                    num_tokens += len(c.token_ids)
                    if done[c.index]:
                        continue
                    lp = b"null"
                    if req.logprobs and c.token_ids:
                        lp = json.dumps({"content": _chat_logprobs(c, num_top)}).encode()
                    if c.text or c.finish_reason is not None or lp != b"null":
                        yield renderer.chunk(c.index, c.text, c.finish_reason, lp)
                    if c.finish_reason is not None:
                        done[c.index] = True
        except APIError as exc:
            yield error_event(exc.message, exc.status)
        else:
            if req.include_usage:
                yield renderer.usage_chunk(usage(len(ids), num_tokens, cached[0]))
        yield DONE

    async def _complete(
        self,
        req: ChatCompletionRequest,
        text: str,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        created: int,
    ) -> bytes:
        timer = self.metrics.start(len(ids))
        cached: list[int | None] = [None]
        outputs, _ = await self.collect(
            note_cached_tokens(self.generate(ids, text, params, request_id, timer), cached),
            params.n,
        )
        choices = []
        for c in outputs:
            lp = None
            if req.logprobs:
                lp = {"content": _chat_logprobs(c, req.top_logprobs or 0), "refusal": None}
            choices.append(
                {
                    "index": c.index,
                    "message": {
                        "role": "assistant",
                        "content": c.text,
                        "refusal": None,
                        "tool_calls": [],
                    },
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        body = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.model_name,
            "choices": choices,
            "usage": usage(len(ids), sum(len(c.token_ids) for c in outputs), cached[0]),
            "system_fingerprint": None,
        }
        return json.dumps(body, separators=(",", ":")).encode()


def _chat_logprobs(c: CompletionOutput, num_top: int) -> list[dict[str, Any]]:
    """OpenAI's chat shape: per token its string, logprob, UTF-8 bytes and the
    `num_top` most likely alternatives."""
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs or (), strict=False):
        chosen = entry.get(token_id)
        token = token_str(token_id, chosen) if chosen else str(token_id)
        content.append(
            {
                "token": token,
                "logprob": chosen.logprob if chosen else None,
                "bytes": list(token.encode()),
                "top_logprobs": [
                    {
                        "token": token_str(t, v),
                        "logprob": v.logprob,
                        "bytes": list(token_str(t, v).encode()),
                    }
                    for t, v in top_entries(entry, num_top)
                ],
            }
        )
    return content
