"""`POST /v1/chat/completions`: messages rendered through the model's chat
template, `n` choices, streamed as SSE or answered whole, with chat `logprobs`."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Any

from starlette.responses import Response

from asyncllm.chat_template import ChatTemplate, ChatTemplateError, prepare_messages
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import CompletionOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.limits import Admission
from asyncllm.server.logprobs import chat_logprobs
from asyncllm.server.metrics import ServerMetrics
from asyncllm.server.output_parser import OutputParser
from asyncllm.server.protocol import APIError, ChatCompletionRequest, ChatMessage, bad_request
from asyncllm.server.reasoning import get_reasoning_parser
from asyncllm.server.serving_base import (
    ServerConfig,
    ServingBase,
    join_body,
    off_loop,
    random_id,
    usage,
)
from asyncllm.server.serving_tools import (
    ToolPlan,
    ToolStream,
    constrain,
    output_parser,
    plan_tools,
    tool_message,
)
from asyncllm.server.sse import DONE, ChunkRenderer, SSEResponse, error_event, run_until_disconnect
from asyncllm.server.template_inputs import RequestTemplates, check_template_kwargs
from asyncllm.server.token_text import TokenText
from asyncllm.server.tool_parsers import get_tool_parser

JSON = "application/json"


@dataclass
class Prepared:
    """A chat request ready to run: its tool plan, prompt and sampling."""

    plan: ToolPlan | None
    text: str
    ids: list[int]
    params: SamplingParams
    lora: LoRARequest | None = None  # the adapter the request's model names

    def fields(self) -> tuple[ToolPlan | None, str, list[int], SamplingParams]:
        return self.plan, self.text, self.ids, self.params


class ChatServing(ServingBase):
    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        metrics: ServerMetrics,
        template: ChatTemplate | None,
        admission: Admission | None = None,
        token_text: TokenText | None = None,
    ) -> None:
        super().__init__(engine, config, metrics, admission, token_text)
        tok = engine.tokenizer
        self.templates = RequestTemplates(template, config, tok.bos_token, tok.eos_token)
        self.tool_parser = get_tool_parser(config.tool_call_parser)
        self.reasoning_parser = get_reasoning_parser(config.reasoning_parser)

    def template_inputs(
        self, chat_template: str | None, kwargs: dict[str, Any] | None, tools: Any = None
    ) -> tuple[ChatTemplate | None, dict[str, Any]]:
        """The template a request renders with and the variables it adds: its
        validated `tools` (None: none) and its checked `chat_template_kwargs`
        (template_inputs); a 400 names what is refused."""
        template = self.templates.template_for(chat_template)
        extra = {"tools": tools} if tools else {}
        extra.update(check_template_kwargs(kwargs, self.config))
        return template, extra

    def render_prompt(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
        template: ChatTemplate | None = None,
    ) -> str:
        """The prompt text, with `template` (None: the server's). The template
        writes the special tokens itself (BOS included), so the tokenizer adds
        none. Pure: runs on a worker thread."""
        template = template or self.templates.default
        if template is None:
            raise bad_request(
                "this model has no chat template: start the server with --chat-template FILE, "
                "or use /v1/completions",
                "messages",
            )
        try:
            dicts = prepare_messages([m.model_dump(exclude_none=True) for m in messages])
            return template.render(dicts, add_generation_prompt, extra)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages") from None

    async def tokenize_messages(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
        template: ChatTemplate | None = None,
    ) -> tuple[str, list[int]]:
        """The rendered prompt and its ids, within the limits; off the event loop."""
        self.limits.check_messages(messages)
        text = await off_loop(self.render_prompt, messages, add_generation_prompt, extra, template)
        self.limits.check_chars(len(text), "messages")
        return text, await self.encode(text, add_special_tokens=False)

    async def prepare(self, req: ChatCompletionRequest) -> Prepared:
        """Everything a chat request needs before it runs, checked (a 4xx names
        the field at fault): the Responses and Messages endpoints come through
        here too, as a chat request built from theirs."""
        lora = self.check_model(req.model)
        self.limits.check_sampling(req)
        plan = plan_tools(req, self.tool_parser)
        template, extra = self.template_inputs(
            req.chat_template, req.chat_template_kwargs, plan.tools if plan else None
        )
        text, ids = await self.tokenize_messages(
            req.messages, req.add_generation_prompt, extra, template
        )
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = self.max_tokens_for(len(ids), req.requested_max_tokens, param, "messages")
        params = req.sampling_params(max_tokens)
        if plan:
            params = constrain(req, plan, params)
        params = self.after_reasoning(params)
        await self.check_params(params)
        self.limits.check_response_size(
            [len(ids)],
            [max_tokens],
            params.n,
            echo=False,
            logprobs=params.logprobs,
            chat=True,
            stream=req.stream,
        )
        return Prepared(plan, text, ids, params, lora)

    def after_reasoning(self, params: SamplingParams) -> SamplingParams:
        """With a reasoning parser, a request's constraint (response_format,
        structured_outputs, a forced tool call) applies to the answer after the
        reasoning, which stays free text: constraining the reasoning would force
        the answer's format onto the thinking, or leave no answer at all."""
        constraint = params.structured_outputs
        if self.reasoning_parser is None or constraint is None:
            return params
        if self.config.structured_outputs_in_reasoning:
            return params
        tags = self.reasoning_parser.tags
        return params.clone(structured_outputs=replace(constraint, after_reasoning=tags))

    def parser(self, plan: ToolPlan | None) -> OutputParser | None:
        """A parser for one choice of a request with `plan` (None: plain text)."""
        return output_parser(plan, self.reasoning_parser)

    async def create(self, req: ChatCompletionRequest, receive: Any) -> Response:
        prep = await self.prepare(req)
        plan, text, ids, params = prep.fields()
        self.check_engine()
        ticket = self.admission.admit(params.n)
        request_id = random_id("chatcmpl")
        created = int(time.time())
        if req.stream:
            chunks = self._stream(req, plan, text, ids, params, request_id, created, prep.lora)
            return SSEResponse(chunks, on_close=ticket.release)
        try:
            work = self._complete(req, plan, text, ids, params, request_id, created, prep.lora)
            body = await run_until_disconnect(receive, work)
        finally:
            ticket.release()
        if body is None:
            return Response(status_code=499)
        return Response(body, media_type=JSON)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan | None,
        text: str,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        created: int,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[bytes]:
        renderer = ChunkRenderer(
            request_id, created, self.echoed_model(req.model), True, req.include_usage
        )
        n = params.n
        for i in range(n):
            yield renderer.role_chunk(i)
        reading = (plan and plan.make_parser) or self.reasoning_parser
        tools = ToolStream(plan, renderer, n, self.reasoning_parser) if reading else None
        done = [False] * n
        num_top = req.top_logprobs or 0
        num_tokens = 0
        timer = self.metrics.start(len(ids))
        num_cached = None
        try:
            async for out in self.generate(ids, text, params, request_id, timer, lora):
                if out.num_cached_tokens is not None:
                    num_cached = out.num_cached_tokens
                for c in out.outputs:
                    num_tokens += len(c.token_ids)
                    if done[c.index]:
                        continue
                    lp = b"null"
                    if req.logprobs and c.token_ids:
                        content = chat_logprobs(self.token_text, c, num_top)
                        lp = json.dumps({"content": content}).encode()
                    if tools is not None:
                        chunk = tools.chunk(c.index, c.text, c.finish_reason, lp)
                        if chunk is not None:
                            yield chunk
                    elif c.text or c.finish_reason is not None or lp != b"null":
                        yield renderer.chunk(c.index, c.text, c.finish_reason, lp)
                    if c.finish_reason is not None:
                        done[c.index] = True
        except APIError as exc:
            yield error_event(exc.message, exc.status)
        else:
            if req.include_usage:
                yield renderer.usage_chunk(usage(len(ids), num_tokens, num_cached))
        yield DONE

    async def _complete(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan | None,
        text: str,
        ids: list[int],
        params: SamplingParams,
        request_id: str,
        created: int,
        lora: LoRARequest | None = None,
    ) -> bytes:
        timer = self.metrics.start(len(ids))
        outputs, _, num_cached = await self.collect(
            self.generate(ids, text, params, request_id, timer, lora), params.n
        )
        return await off_loop(self._build, req, plan, ids, outputs, num_cached, request_id, created)

    def _build(
        self,
        req: ChatCompletionRequest,
        plan: ToolPlan | None,
        ids: list[int],
        outputs: list[CompletionOutput],
        num_cached: int | None,
        request_id: str,
        created: int,
    ) -> bytes:
        """The whole response body; runs on a worker thread, one choice at a time."""
        choices = []
        for c in outputs:
            lp = None
            if req.logprobs:
                content = chat_logprobs(self.token_text, c, req.top_logprobs or 0)
                lp = {"content": content, "refusal": None}
            message: dict[str, Any] = {
                "role": "assistant",
                "content": c.text,
                "refusal": None,
                "tool_calls": [],
            }
            finish_reason = c.finish_reason
            if (plan and plan.make_parser) or self.reasoning_parser:
                message, finish_reason = tool_message(
                    plan, c.text, c.finish_reason, self.reasoning_parser
                )
            choice = {
                "index": c.index,
                "message": message,
                "logprobs": lp,
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            }
            choices.append(json.dumps(choice, separators=(",", ":")).encode())
        head = {
            "id": request_id,
            "object": "chat.completion",
            "created": created,
            "model": self.echoed_model(req.model),
            "usage": usage(len(ids), sum(len(c.token_ids) for c in outputs), num_cached),
            "system_fingerprint": None,
        }
        return join_body(head, choices)
