"""Raw HTTP/1.1 over asyncio streams, for clients the `openai` package cannot be:
bodies of arbitrary bytes, lying or missing Content-Length, partial headers,
streams read slowly or dropped at any byte; plus what the abuse tests read from
the server's side (metrics, resident memory, open sockets).

Only what the tests need: one request per connection (`Connection: close`),
Content-Length or chunked response bodies, server-sent events split on blank lines.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"


@dataclass
class Reply:
    """One HTTP response as read off the socket."""

    status: int
    headers: dict[str, str]
    body: bytes
    elapsed: float = 0.0
    events: list[bytes] = field(default_factory=list)  # SSE data payloads, if streamed
    complete: bool = True  # False: the server closed the connection mid-body

    def json(self) -> Any:
        return json.loads(self.body)

    def error(self) -> dict[str, Any]:
        """The OpenAI error object of a 4xx/5xx body (raises if not that shape)."""
        payload = self.json()
        assert set(payload) == {"error"}, payload
        return payload["error"]


def request_head(
    method: str,
    path: str,
    body_length: int | None,
    headers: dict[str, str] | None = None,
) -> bytes:
    """The request line and headers; Content-Length when `body_length` is not None."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Connection: close"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if body_length is not None:
        all_headers["Content-Length"] = str(body_length)
    lines += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and headers of a response (lower-case names)."""
    raw = await reader.readuntil(b"\r\n\r\n")
    lines = raw.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        if ":" in line:
            name, value = line.split(":", 1)
            headers[name.strip().lower()] = value.strip()
    return status, headers


async def iter_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's pieces as they arrive: chunked, Content-Length, or until EOF."""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                return
            data = await reader.readexactly(size + 2)
            yield data[:-2]
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length:
            yield await reader.readexactly(length)
    else:
        while data := await reader.read(65536):
            yield data


def sse_payloads(buffer: bytearray) -> list[bytes]:
    """Removes the whole events at the front of `buffer`; their `data:` payloads."""
    out = []
    while (end := buffer.find(b"\n\n")) >= 0:
        event = bytes(buffer[:end])
        del buffer[: end + 2]
        for line in event.split(b"\n"):
            if line.startswith(b"data: "):
                out.append(line[6:])
    return out


async def request(
    port: int,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
    *,
    timeout: float = 60.0,
) -> Reply:
    """One whole request and its whole response; a streamed response's SSE
    payloads are split into `Reply.events`."""

    async def go() -> Reply:
        start = time.perf_counter()
        reader, writer = await asyncio.open_connection(HOST, port, limit=2**24)
        try:
            head = request_head(method, path, None if body is None else len(body), headers)
            writer.write(head + (body or b""))
            await writer.drain()
            status, resp_headers = await read_head(reader)
            parts = []
            complete = True
            try:
                async for piece in iter_body(reader, resp_headers):
                    parts.append(piece)
            except (asyncio.IncompleteReadError, ConnectionError):
                complete = False
            whole = b"".join(parts)
            events = []
            if resp_headers.get("content-type", "").startswith("text/event-stream"):
                events = sse_payloads(bytearray(whole))
            elapsed = time.perf_counter() - start
            return Reply(status, resp_headers, whole, elapsed, events, complete)
        finally:
            writer.close()

    return await asyncio.wait_for(go(), timeout)


async def post_json(port: int, path: str, payload: Any, *, timeout: float = 60.0) -> Reply:
    return await request(port, "POST", path, json.dumps(payload).encode(), timeout=timeout)


def stream_text(events: list[bytes]) -> str:
    """The generated text of a streamed completion or chat response (choice 0)."""
    text = []
    for data in events:
        if data == b"[DONE]":
            break
        chunk = json.loads(data)
        for choice in chunk.get("choices") or ():
            if "text" in choice:
                text.append(choice["text"])
            else:
                text.append(choice.get("delta", {}).get("content") or "")
    return "".join(text)


async def is_closed_by_server(reader: asyncio.StreamReader, within: float) -> tuple[bool, bytes]:
    """Whether the server closes the connection within `within` seconds (reading
    and keeping whatever it sends first, e.g. a 408)."""
    got = bytearray()
    deadline = time.monotonic() + within
    try:
        while (left := deadline - time.monotonic()) > 0:
            data = await asyncio.wait_for(reader.read(65536), left)
            if not data:
                return True, bytes(got)
            got += data
    except TimeoutError:
        return False, bytes(got)
    except ConnectionError:
        return True, bytes(got)
    return False, bytes(got)


# -- the server's side --------------------------------------------------------------------


async def scrape(port: int) -> dict[str, float]:
    """Every unlabelled-enough sample of /metrics by name (one model; the finish
    reason kept as `{reason}`)."""
    reply = await request(port, "GET", "/metrics", timeout=30)
    assert reply.status == 200, reply
    samples = {}
    for family in text_string_to_metric_families(reply.body.decode()):
        for s in family.samples:
            key = s.name
            if "finished_reason" in s.labels:
                key += "{" + s.labels["finished_reason"] + "}"
            if "le" not in s.labels:
                samples[key] = s.value
    return samples


async def wait_idle(port: int, within: float = 30.0) -> dict[str, float]:
    """Polls /metrics until nothing runs or waits and no KV block is in use (or
    `within` seconds pass); the last scrape."""
    deadline = time.monotonic() + within
    while True:
        m = await scrape(port)
        idle = (
            m.get("asyncllm:num_requests_running") == 0
            and m.get("asyncllm:num_requests_waiting") == 0
            and m.get("asyncllm:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.1)


def resident_kib(pid: int) -> int:
    """VmRSS of a process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


# /proc/net/tcp states: 01 ESTABLISHED, 08 CLOSE_WAIT (the peer left, we did not close)
_OPEN_STATES = {"01": "ESTABLISHED", "08": "CLOSE_WAIT"}


def open_server_sockets(port: int) -> list[str]:
    """The server's accepted connections on `port` that are still open (established,
    or closed by the client but not by the server), as 'remote-port STATE'."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            local, remote, state = cols[1], cols[2], cols[3]
            if int(local.rsplit(":", 1)[1], 16) == port and state in _OPEN_STATES:
                found.append(f"{int(remote.rsplit(':', 1)[1], 16)} {_OPEN_STATES[state]}")
    return found
