"""Limits uvicorn does not have, on its HTTP protocol (one instance per
connection): a cap on open connections, a deadline and a size limit for a
request's headers, and a deadline for a client that stops reading its response.

- Headers: timed from the connection's first byte (or the first byte of the next
  request on a kept-alive connection) to the end of the headers; a client that
  sends part and goes silent gets 408 and is closed after `header_timeout`, one
  that keeps sending gets 431 past `max_header_bytes`. The header section that
  arrives whole is measured again by the gateway middleware.
- Responses: the transport calls `pause_writing` when its buffer fills because
  the client does not read. If it stays full for `stream_idle_timeout` the
  connection is aborted; the app sees the client disconnect, so the request is
  aborted in the engine and its admission slots are freed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from asyncllm.server.config import ServerConfig
from asyncllm.server.protocol import APIError

logger = logging.getLogger(__name__)

_LOG_EVERY_S = 10.0  # at most one line per kind of cut-off client per this
_last_logged: dict[str, float] = {}


def log_cut_off(kind: str, message: str, *args: object) -> None:
    """Log that a client was cut off, at most once per kind every 10 s: a flood
    of slow clients must not become a flood of log lines."""
    now = time.monotonic()
    if now - _last_logged.get(kind, -_LOG_EVERY_S) >= _LOG_EVERY_S:
        _last_logged[kind] = now
        logger.info(message + " (further ones not logged for %gs)", *args, _LOG_EVERY_S)


def _raw_response(status: int, reason: str, message: str) -> bytes:
    """A whole response written below the app (no request was parsed), in the
    same OpenAI error shape the app answers with."""
    body = APIError(status, message).body()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class _LimitsMixin:
    """Mixed in front of uvicorn's HTTP protocol class (httptools or h11); it
    relies on their shared attributes: loop, transport, cycle, connections."""

    limits: ServerConfig
    # uvicorn's protocol provides these
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any
    connections: set[Any]

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        limit = self.limits.max_connections
        if len(self.connections) > limit:
            log_cut_off("connections", "over the limit of %d open connections: refusing", limit)
            message = f"this server accepts at most {limit} connections (--max-connections)"
            transport.write(_raw_response(503, "Service Unavailable", message))
            transport.close()
            return
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():  # cut off already: parse nothing more
            return
        cycle = self.cycle
        waiting = cycle is None or cycle.response_complete  # for a request's headers
        if waiting and self._header_timer is None:
            self._arm_header_timer()
        super().data_received(data)  # type: ignore[misc]
        if self.cycle is not cycle:  # a request's headers are complete
            self._header_bytes = 0
            self._cancel_header_timer()
        elif waiting and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.limits.max_header_bytes:
                self._close_with(
                    431,
                    "Request Header Fields Too Large",
                    f"the request's headers exceed {self.limits.max_header_bytes} bytes "
                    "(--max-header-bytes)",
                )

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        if self._stall_timer is None:
            timeout = self.limits.stream_idle_timeout
            self._stall_timer = self.loop.call_later(timeout, self._on_stall)

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        if getattr(self, "_stall_timer", None) is not None:
            self._stall_timer.cancel()  # type: ignore[union-attr]
            self._stall_timer = None
        super().connection_lost(exc)  # type: ignore[misc]

    # -- timers -------------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._header_timer = self.loop.call_later(
            self.limits.header_timeout, self._on_header_timeout
        )

    def _cancel_header_timer(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _on_header_timeout(self) -> None:
        self._header_timer = None
        log_cut_off(
            "headers",
            "a client did not send its headers within %gs: closed",
            self.limits.header_timeout,
        )
        self._close_with(
            408,
            "Request Timeout",
            f"the request's headers did not arrive within {self.limits.header_timeout:g} s "
            "(--header-timeout)",
        )

    def _on_stall(self) -> None:
        self._stall_timer = None
        log_cut_off(
            "stall",
            "a client has not read its response for %gs: connection closed",
            self.limits.stream_idle_timeout,
        )
        self.transport.abort()

    def _close_with(self, status: int, reason: str, message: str) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self.transport.write(_raw_response(status, reason, message))
            self.transport.close()


def protocol_class(config: ServerConfig) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (httptools when installed, else h11) with the limits."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    return type("LimitedHTTPProtocol", (_LimitsMixin, AutoHTTPProtocol), {"limits": config})


def uvicorn_options(config: ServerConfig) -> dict[str, Any]:
    """The `uvicorn.Config` keywords that apply the connection-level limits."""
    return {
        "http": protocol_class(config),
        "h11_max_incomplete_event_size": config.max_header_bytes,
    }
