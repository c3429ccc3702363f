"""`POST /v1/messages` (the Anthropic Messages API) and
`/v1/messages/count_tokens`: a request is translated into a chat request
(protocol_messages), run as one turn (turn.run_turn) and answered as a message
— content blocks `thinking` (with a reasoning parser), `text` and `tool_use` —
or streamed as Anthropic's events:

    message_start, then per block content_block_start, content_block_delta
    (text_delta, thinking_delta or input_json_delta) ..., content_block_stop,
    then message_delta (stop_reason, usage) and message_stop.

A non-streamed reply is the same builder with its events dropped."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response

from asyncllm.server.limits import over_limit
from asyncllm.server.output_parser import OutputDelta
from asyncllm.server.protocol import APIError
from asyncllm.server.protocol_messages import MessagesRequest, anthropic_error_body, chat_body
from asyncllm.server.responses_output import item_id, sse
from asyncllm.server.serving_chat import ChatServing, Prepared
from asyncllm.server.serving_responses import prepare_as, to_chat_request
from asyncllm.server.serving_tools import plan_tools
from asyncllm.server.sse import SSEResponse, run_until_disconnect
from asyncllm.server.tool_parsers import ToolCallDelta
from asyncllm.server.turn import TurnEnd, run_turn

JSON = "application/json"


class MessageBuilder:
    """One reply's content blocks and events; `start`, `delta` per OutputDelta,
    `end` once."""

    def __init__(self, message_id: str, model: str, num_prompt_tokens: int) -> None:
        self.head = {"id": message_id, "type": "message", "role": "assistant", "model": model}
        self.content: list[dict[str, Any]] = []
        self.num_prompt_tokens = num_prompt_tokens
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage: dict[str, Any] = {"input_tokens": num_prompt_tokens, "output_tokens": 0}
        self._open: dict[str, Any] | None = None
        self._parts: list[str] = []

    def body(self) -> dict[str, Any]:
        return {
            **self.head,
            "content": self.content,
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": self.usage,
        }

    def start(self) -> list[bytes]:
        return [sse("message_start", {"type": "message_start", "message": self.body()})]

    def delta(self, d: OutputDelta) -> list[bytes]:
        events: list[bytes] = []
        if d.reasoning:
            if self._kind() != "thinking":
                events += self._close()
                events += self._add({"type": "thinking", "thinking": "", "signature": ""})
            events.append(self._piece({"type": "thinking_delta", "thinking": d.reasoning}))
            self._parts.append(d.reasoning)
        if d.content:
            if self._kind() != "text":
                events += self._close()
                events += self._add({"type": "text", "text": ""})
            events.append(self._piece({"type": "text_delta", "text": d.content}))
            self._parts.append(d.content)
        for piece in d.tool_calls:
            events += self._call_piece(piece)
        return events

    def _call_piece(self, piece: ToolCallDelta) -> list[bytes]:
        events: list[bytes] = []
        if piece.id is not None:
            events += self._close()
            events += self._add(
                {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
            )
        if piece.arguments and self._kind() == "tool_use":
            events.append(
                self._piece({"type": "input_json_delta", "partial_json": piece.arguments})
            )
            self._parts.append(piece.arguments)
        return events

    def end(self, end: TurnEnd) -> list[bytes]:
        events = self._close()
        if end.finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif end.has_calls:
            self.stop_reason = "tool_use"
        elif isinstance(end.stop_reason, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", end.stop_reason
        else:
            self.stop_reason = "end_turn"
        self.usage = {"input_tokens": end.num_prompt_tokens, "output_tokens": end.num_output_tokens}
        if end.num_cached_tokens is not None:
            self.usage["cache_read_input_tokens"] = end.num_cached_tokens
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        events.append(
            sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage})
        )
        events.append(sse("message_stop", {"type": "message_stop"}))
        return events

    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _add(self, block: dict[str, Any]) -> list[bytes]:
        self._open = block
        self._parts = []
        self.content.append(block)
        payload = {"type": "content_block_start", "index": len(self.content) - 1}
        return [sse("content_block_start", {**payload, "content_block": dict(block)})]

    def _piece(self, delta: dict[str, Any]) -> bytes:
        payload = {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        return sse("content_block_delta", payload)

    def _close(self) -> list[bytes]:
        block = self._open
        if block is None:
            return []
        self._open = None
        text = "".join(self._parts)
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(text) if text else {}
            except ValueError:  # a call cut by max_tokens: its text, as given
                block["input"] = {"_raw": text}
        else:
            block[block["type"]] = text
        payload = {"type": "content_block_stop", "index": len(self.content) - 1}
        return [sse("content_block_stop", payload)]


class MessagesServing:
    def __init__(self, chat: ChatServing) -> None:
        self.chat = chat

    def _chat_request(self, req: MessagesRequest) -> Any:
        limits = self.chat.limits
        limits.check_stop(req.stop_sequences, "stop_sequences")
        limit = self.chat.config.max_response_input_items
        if len(req.messages) > limit:
            raise over_limit(
                "messages", "messages", len(req.messages), "max_response_input_items", limit
            )
        return to_chat_request(chat_body(req))

    async def count_tokens(self, req: MessagesRequest) -> dict[str, int]:
        chat_req = self._chat_request(req)
        chat = self.chat
        chat.check_model(chat_req.model)
        plan = plan_tools(chat_req, chat.tool_parser)
        template, extra = chat.template_inputs(
            None, chat_req.chat_template_kwargs, plan.tools if plan else None
        )
        _, ids = await chat.tokenize_messages(chat_req.messages, True, extra, template)
        return {"input_tokens": len(ids)}

    async def create(self, req: MessagesRequest, receive: Any) -> Response:
        chat = self.chat
        prep = await prepare_as(chat, self._chat_request(req), {"stop": "stop_sequences"})
        chat.check_engine()
        ticket = chat.admission.admit(1)
        builder = MessageBuilder(item_id("msg"), chat.echoed_model(req.model), len(prep.ids))
        if req.stream:
            return SSEResponse(self._stream(prep, builder), on_close=ticket.release)
        try:
            body = await run_until_disconnect(receive, self._complete(prep, builder))
        finally:
            ticket.release()
        if body is None:
            return Response(status_code=499)
        return Response(json.dumps(body, ensure_ascii=False), media_type=JSON)

    async def _complete(self, prep: Prepared, builder: MessageBuilder) -> dict[str, Any]:
        async for item in run_turn(self.chat, prep, builder.head["id"]):
            if isinstance(item, TurnEnd):
                builder.end(item)
            else:
                builder.delta(item)
        return builder.body()

    async def _stream(self, prep: Prepared, builder: MessageBuilder) -> AsyncIterator[bytes]:
        for event in builder.start():
            yield event
        try:
            async for item in run_turn(self.chat, prep, builder.head["id"]):
                events = builder.end(item) if isinstance(item, TurnEnd) else builder.delta(item)
                for event in events:
                    yield event
        except APIError as exc:
            yield b"event: error\ndata: " + anthropic_error_body(exc) + b"\n\n"
