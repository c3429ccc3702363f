"""`POST /v1/responses` (the OpenAI Responses API), `GET` and `DELETE
/v1/responses/{id}`: a request is translated into a chat request
(protocol_responses), run as one turn (turn.run_turn) and rendered as a response
object or its typed event stream (responses_output). With --enable-store a
response asked to be stored is kept (response_store) under the client's API key,
for GET and for a later request's `previous_response_id`."""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.responses import Response

from asyncllm.server.limits import over_limit
from asyncllm.server.protocol import APIError, ChatCompletionRequest, bad_request
from asyncllm.server.protocol_responses import (
    ResponsesRequest,
    chat_body,
    input_messages,
    json_size,
    output_messages,
)
from asyncllm.server.response_store import ResponseStore, StoredResponse
from asyncllm.server.responses_output import ResponseBuilder, item_id, sse
from asyncllm.server.serving_base import off_loop
from asyncllm.server.serving_chat import ChatServing, Prepared
from asyncllm.server.sse import SSEResponse, run_until_disconnect
from asyncllm.server.turn import TurnEnd, run_turn

JSON = "application/json"


# The chat fields a translated request fills, by the name its client sent.
_RESPONSES_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}


async def prepare_as(
    chat: ChatServing, req: ChatCompletionRequest, names: dict[str, str]
) -> Prepared:
    """`chat.prepare(req)`, its errors naming the fields as the client's API
    spells them (`max_output_tokens`, not the chat field it was translated to)."""
    try:
        return await chat.prepare(req)
    except APIError as exc:
        for chat_name, name in names.items():  # the word, never part of a flag's name
            exc.message = re.sub(rf"(?<![\w-]){chat_name}(?![\w-])", name, exc.message, count=1)
        if exc.param in names:
            exc.param = names[exc.param]
        raise


def to_chat_request(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request a translated body makes; a 400 naming the chat field
    (the translation keeps the names where they differ only in spelling)."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = str(first["loc"][0]) if first["loc"] else None
        raise bad_request(f"{param or 'body'}: {first['msg']}", param) from None


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None) -> None:
        self.chat = chat
        self.store = store
        self.config = chat.config

    def _history(self, req: ResponsesRequest, scope: str) -> list[dict[str, Any]]:
        if req.previous_response_id is None:
            return []
        if self.store is None:
            raise bad_request(
                "previous_response_id needs a server that stores responses (--enable-store)",
                "previous_response_id",
            )
        stored = self.store.get(scope, req.previous_response_id)
        if stored is None:
            raise APIError(
                404,
                f"no stored response with id {req.previous_response_id[:64]!r}",
                param="previous_response_id",
                code="response_not_found",
            )
        return list(stored.conversation)

    async def create(self, req: ResponsesRequest, receive: Any, scope: str) -> Response:
        chat = self.chat
        req.check_metadata()
        messages = self._history(req, scope) + input_messages(req.input)
        limit = self.config.max_response_input_items
        if len(messages) > limit:
            raise over_limit("input", "items", len(messages), "max_response_input_items", limit)
        chat_req = to_chat_request(chat_body(req, messages))
        prep = await prepare_as(chat, chat_req, _RESPONSES_NAMES)
        chat.check_engine()
        ticket = chat.admission.admit(1)
        store = req.store and self.store is not None
        builder = ResponseBuilder(self._head(req, store))
        if req.stream:
            events = self._stream(prep, builder, messages, scope)
            return SSEResponse(events, on_close=ticket.release)
        try:
            body = await run_until_disconnect(receive, self._complete(prep, builder))
        finally:
            ticket.release()
        if body is None:
            return Response(status_code=499)
        if store:
            self._keep(scope, builder, messages)
        return Response(await off_loop(_dumps, body), media_type=JSON)

    def _head(self, req: ResponsesRequest, store: bool) -> dict[str, Any]:
        return {
            "id": item_id("resp"),
            "object": "response",
            "created_at": int(time.time()),
            "model": self.chat.echoed_model(req.model),
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "store": store,
            "user": req.user,
        }

    async def _complete(self, prep: Prepared, builder: ResponseBuilder) -> dict[str, Any]:
        async for item in run_turn(self.chat, prep, builder.head["id"]):
            if isinstance(item, TurnEnd):
                builder.end(item)
            else:
                builder.delta(item)
        return builder.body()

    async def _stream(
        self,
        prep: Prepared,
        builder: ResponseBuilder,
        messages: list[dict[str, Any]],
        scope: str,
    ) -> AsyncIterator[bytes]:
        for event in builder.start():
            yield event
        try:
            async for item in run_turn(self.chat, prep, builder.head["id"]):
                if not isinstance(item, TurnEnd):
                    events = builder.delta(item)
                else:  # kept before the last event: a client may leave once it has it
                    events = builder.end(item)
                    if builder.head["store"]:
                        self._keep(scope, builder, messages)
                for event in events:
                    yield event
        except APIError as exc:
            error = {"type": "error", "code": str(exc.code or exc.status), "message": exc.message}
            yield sse("error", {**error, "param": exc.param, "sequence_number": 0})

    def _keep(self, scope: str, builder: ResponseBuilder, messages: list[dict[str, Any]]) -> None:
        """Store a finished response (one too large to ever fit is not kept)."""
        assert self.store is not None
        body = builder.body()
        conversation = messages + output_messages(builder.output)
        size = json_size(body) + json_size(conversation)
        if self.store.can_put(size):
            self.store.put(scope, body["id"], StoredResponse(body, conversation, size))

    def stored(self, scope: str, response_id: str) -> dict[str, Any]:
        """GET /v1/responses/{id}: the stored response, or a 404."""
        found = self.store.get(scope, response_id) if self.store is not None else None
        if found is None:
            raise APIError(
                404, f"no stored response with id {response_id[:64]!r}", code="response_not_found"
            )
        return found.body

    def delete(self, scope: str, response_id: str) -> dict[str, Any]:
        if self.store is None or not self.store.delete(scope, response_id):
            raise APIError(
                404, f"no stored response with id {response_id[:64]!r}", code="response_not_found"
            )
        return {"id": response_id, "object": "response.deleted", "deleted": True}


def _dumps(data: Any) -> bytes:
    return json.dumps(data, ensure_ascii=False).encode()
