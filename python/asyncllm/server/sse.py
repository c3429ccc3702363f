"""Server-sent events: chunk bodies from preformatted bytes, and a response that
stops its stream the moment the client goes away.

A streamed request renders one chunk per output per choice; building a pydantic
object (or even a dict for `json.dumps`) for each would dominate the server's CPU
time at high concurrency. `ChunkRenderer` splits a chunk into the constant head
(id, object, created, model) rendered once per request and the parts that change,
of which only the text needs JSON-escaping.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from json.encoder import encode_basestring_ascii as _json_str
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_FINISH = {None: b"null", "stop": b'"stop"', "length": b'"length"', "abort": b'"abort"'}


def finish_json(reason: str | None) -> bytes:
    cached = _FINISH.get(reason)
    return cached if cached is not None else _json_str(str(reason)).encode()


def event(payload: dict[str, Any]) -> bytes:
    """A whole event from a dict (for rare chunks: role, usage, errors)."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class ChunkRenderer:
    """Chunks of one streamed request. `chat` chooses the chat chunk shape
    (`delta.content`) over the completions one (`text`)."""

    def __init__(
        self, request_id: str, created: int, model: str, chat: bool, include_usage: bool
    ) -> None:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": obj, "created": created, "model": model}
        self.head = ("data: " + json.dumps(head, separators=(",", ":"))[:-1]).encode()
        self.chat = chat
        self.usage_null = b',"usage":null' if include_usage else b""

    def chunk(
        self, index: int, text: str, finish_reason: str | None, logprobs: bytes = b"null"
    ) -> bytes:
        if self.chat:
            delta = b'{"content":' + _json_str(text).encode() + b"}" if text else b"{}"
            choice = b'{"index":%d,"delta":%b,"logprobs":%b,"finish_reason":%b}' % (
                index,
                delta,
                logprobs,
                finish_json(finish_reason),
            )
        else:
            choice = b'{"index":%d,"text":%b,"logprobs":%b,"finish_reason":%b}' % (
                index,
                _json_str(text).encode(),
                logprobs,
                finish_json(finish_reason),
            )
        return self.head + b',"choices":[' + choice + b"]" + self.usage_null + b"}\n\n"

    def role_chunk(self, index: int) -> bytes:
        choice = b'{"index":%d,"delta":{"role":"assistant","content":""},' % index
        choice += b'"logprobs":null,"finish_reason":null}'
        return self.head + b',"choices":[' + choice + b"]" + self.usage_null + b"}\n\n"

    def usage_chunk(self, usage: dict[str, int]) -> bytes:
        body = json.dumps(usage, separators=(",", ":")).encode()
        return self.head + b',"choices":[],"usage":' + body + b"}\n\n"


def error_event(message: str, status: int) -> bytes:
    return event({"error": {"message": message, "type": "APIError", "param": None, "code": status}})


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class SSEResponse(Response):
    """Streams `chunks` as `text/event-stream`. When the client disconnects the
    stream's task is cancelled at once, whatever it is waiting on — which closes
    the chunk generator and, through it, aborts the request in the engine."""

    media_type = "text/event-stream"

    def __init__(
        self, chunks: AsyncIterator[bytes], on_close: Callable[[], None] | None = None
    ) -> None:
        self.chunks = chunks
        self.on_close = on_close  # called once the stream has ended, however it ended
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            try:
                aclose = getattr(self.chunks, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                if self.on_close is not None:
                    self.on_close()
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            exc = stream.exception()
            if not isinstance(exc, OSError):  # a send to a client that just left
                raise exc  # type: ignore[misc]

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for chunk in self.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def run_until_disconnect(receive: Receive, work: Coroutine[Any, Any, T]) -> T | None:
    """Await `work`, cancelling it if the client disconnects first (then None):
    how a non-streamed request is aborted when its client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        return None
    return task.result()
