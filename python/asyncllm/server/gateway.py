"""The one pure-ASGI middleware in front of every route (streamed responses pass
through it untouched): the header-size limit, the API key, and reading the
request body within its limits — Content-Length checked before a byte is read,
the bytes counted as they come (chunked uploads), and the whole body within
`body_timeout` seconds. Handlers then get the body at once: a client that is
slow to send it never reaches admission control or holds an engine slot."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Awaitable, Callable

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from asyncllm.server.config import ServerConfig
from asyncllm.server.connection import log_cut_off
from asyncllm.server.protocol import APIError
from asyncllm.server.protocol_messages import anthropic_error_body
from asyncllm.server.ui_routes import is_ui_path

logger = logging.getLogger(__name__)

_OPEN_PATHS = frozenset({"/health"})
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_CLOSE = {"Connection": "close"}


def error_response(exc: APIError, path: str = "") -> Response:
    """The error in the shape of the API the path belongs to: Anthropic's for
    /v1/messages, OpenAI's for the rest."""
    body = anthropic_error_body(exc) if path.startswith("/v1/messages") else exc.body()
    return Response(
        body, status_code=exc.status, media_type="application/json", headers=exc.headers
    )


def route_path(scope: Scope) -> str:
    """The request's path without the root path (`--root-path`) uvicorn put in front."""
    path: str = scope["path"]
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root) :] or "/"
    return path


def header_bytes(scope: Scope) -> int:
    """The size of a request's line and headers, as sent (near enough)."""
    size = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    return size + sum(len(name) + len(value) + 4 for name, value in scope["headers"])


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, config: ServerConfig) -> None:
        self.app = app
        self.api_key = f"Bearer {config.api_key}".encode() if config.api_key else None
        # Anthropic's clients send the key as `x-api-key: KEY`
        self.x_api_key = config.api_key.encode() if config.api_key else None
        self.max_header_bytes = config.max_header_bytes
        self.max_body_bytes = config.max_request_body_bytes
        self.body_timeout = config.body_timeout
        self.ui = config.ui  # the page's own files are open: it asks for the key itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        size = header_bytes(scope)
        if size > self.max_header_bytes:
            await self._reject(
                APIError(
                    431,
                    f"the request's headers have about {size} bytes; this server accepts at "
                    f"most {self.max_header_bytes} (--max-header-bytes)",
                    code="request_header_fields_too_large",
                    headers=_CLOSE,
                ),
                scope,
                receive,
                send,
            )
            return
        path = route_path(scope)
        if self.api_key is not None and not self._is_open(path):
            headers = dict(scope["headers"])
            given = headers.get(b"authorization", b"")
            ok = hmac.compare_digest(given, self.api_key)
            if not ok and b"x-api-key" in headers:
                assert self.x_api_key is not None
                ok = hmac.compare_digest(headers[b"x-api-key"], self.x_api_key)
            if not ok:
                error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                await self._reject(error, scope, receive, send)
                return
        if scope["method"] in _BODY_METHODS:
            try:
                body = await self._read_body(scope, receive)
            except APIError as error:
                await self._reject(error, scope, receive, send)
                return
            if body is None:  # the client left before sending it all: nobody to answer
                logger.debug("client left before sending its body: %s", scope["path"])
                return
            receive = _replay(body, receive)
        await self.app(scope, receive, send)

    def _is_open(self, path: str) -> bool:
        return path in _OPEN_PATHS or (self.ui and is_ui_path(path))

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        limit = self.max_body_bytes
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None:
            if not declared.strip().isdigit():
                raise APIError(400, "invalid Content-Length header", headers=_CLOSE)
            if int(declared) > limit:
                raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.body_timeout):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > limit:
                        raise _too_large(limit)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        break
        except TimeoutError:
            log_cut_off(
                "body", "a request body did not arrive within %gs: closed", self.body_timeout
            )
            raise APIError(
                408,
                f"the request body did not arrive within {self.body_timeout:g} s (--body-timeout)",
                code="request_timeout",
                headers=_CLOSE,
            ) from None
        return b"".join(chunks)

    @staticmethod
    async def _reject(error: APIError, scope: Scope, receive: Receive, send: Send) -> None:
        await error_response(error, route_path(scope))(scope, receive, send)


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes "
        "(--max-request-body-bytes)",
        code="request_too_large",
        headers=_CLOSE,
    )


def _replay(body: bytes, receive: Receive) -> Callable[[], Awaitable[Message]]:
    """A receive that hands the app the body already read, then passes on
    (to see the client disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
