"""Slow and idle clients against a real `asyncllm serve` with 2-second timeouts and
room for 16 sequences: partial headers, a body that never comes (or trickles),
streams nobody reads, more connections than allowed. Each is cut off by its
timeout or cap, and none holds an admission slot past it: a normal request is
served afterwards, and the engine ends with nothing running and no KV block used.

Deadlines here are many times the configured timeouts: they catch a connection
held forever, not a slow machine.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from pathlib import Path

import pytest
from abuse_http import (
    HOST,
    is_closed_by_server,
    open_server_sockets,
    post_json,
    read_head,
    request,
    request_head,
    wait_idle,
)

from server_process import Server

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2
MAX_SEQS = 16
MAX_CONNECTIONS = 24
MAX_MODEL_LEN = 512  # asyncllm-tiny's
LONG_TOKEN_ID = 7460  # asyncllm-tiny's longest token as JSON: a large echo
CUT_OFF_WITHIN_S = 10 * TIMEOUT_S  # a connection still open after this is held forever
SMALL = {"prompt": "x", "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("abuse-slow") / "server.log"
    flags = ["--header-timeout", "--body-timeout", "--stream-idle-timeout"]
    args = [a for flag in flags for a in (flag, str(TIMEOUT_S))]
    args += ["--max-concurrent-requests", str(MAX_SEQS), "--max-connections", str(MAX_CONNECTIONS)]
    srv = Server(log, *args)
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


async def _connect(port: int, rcvbuf: int | None = None):
    if rcvbuf is None:
        return await asyncio.open_connection(HOST, port)
    sock = socket.socket()
    # a small receive window (set before connecting) so an unread stream fills it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    return await asyncio.open_connection(sock=sock)


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every: float) -> None:
    """Sends `data` a byte at a time until the server closes the connection."""
    try:
        for i in range(len(data)):
            writer.write(data[i : i + 1])
            await writer.drain()
            await asyncio.sleep(every)
    except ConnectionError:
        return


async def _served_now(port: int) -> int:
    return (await post_json(port, "/v1/completions", SMALL)).status


async def _served_within(port: int, seconds: float) -> int:
    """Retries a small request until it is not refused (429); its last status."""
    deadline = time.monotonic() + seconds
    while True:
        status = await _served_now(port)
        if status != 429 or time.monotonic() > deadline:
            return status
        await asyncio.sleep(0.25)


def test_partial_headers_are_cut_off(server):
    async def run() -> None:
        partial = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Ty"
        conns = [await _connect(server.port) for _ in range(8)]
        for _, writer in conns:
            writer.write(partial)
            await writer.drain()
        # slowloris: a header byte every 0.2 s never completes within the timeout
        slow = [await _connect(server.port) for _ in range(2)]
        head = request_head("POST", "/v1/completions", 2) + b"{}"
        trickles = [asyncio.ensure_future(_trickle(w, head, 0.2)) for _, w in slow]
        results = await asyncio.gather(
            *(is_closed_by_server(r, CUT_OFF_WITHIN_S) for r, _ in conns + slow)
        )
        for closed, sent in results:
            assert closed, sent
            if sent:  # an answer before closing is an error, never a served request
                assert sent.startswith(b"HTTP/1.1 4"), sent[:200]
        await asyncio.gather(*trickles)
        for _, writer in conns + slow:
            writer.close()
        assert (await request(server.port, "GET", "/health")).status == 200
        assert await _served_now(server.port) == 200

    asyncio.run(run())


def test_bodies_that_never_come_hold_no_slot(server):
    async def run() -> None:
        head = request_head("POST", "/v1/completions", 200)
        silent = [await _connect(server.port) for _ in range(4)]
        for _, writer in silent:
            writer.write(head + b'{"prompt": ')
            await writer.drain()
        trickler = await _connect(server.port)
        trickler[1].write(head)
        trickle = asyncio.ensure_future(
            _trickle(trickler[1], json.dumps(SMALL).encode().ljust(200), 0.2)
        )
        # a client that sends half a body and leaves
        _, quitter = await _connect(server.port)
        quitter.write(head + b'{"prompt": "x"')
        await quitter.drain()
        quitter.close()
        # admission comes after the body: the waiting clients hold no slot
        assert await _served_now(server.port) == 200
        for reader, _ in [*silent, trickler]:
            status, _ = await asyncio.wait_for(read_head(reader), CUT_OFF_WITHIN_S)
            assert status == 408
            closed, rest = await is_closed_by_server(reader, CUT_OFF_WITHIN_S)
            assert closed, rest
        await trickle
        for _, writer in [*silent, trickler]:
            writer.close()
        assert await _served_now(server.port) == 200

    asyncio.run(run())


def _kernel_send_buffer_max() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    except (OSError, IndexError, ValueError):
        return 4 << 20  # Linux's default


def test_unread_streams_are_aborted_and_free_their_slots(server):
    if _kernel_send_buffer_max() > 5 << 20:
        pytest.skip("the kernel could buffer the whole ~7 MB response: nothing would stall")

    async def run() -> None:
        # Every slot in one streamed request of about 7 MB, most of it in the first
        # chunks (the echoed prompts' logprobs): more than the kernel's send buffer
        # (at most 4 MiB by default) and the transport's together, so the
        # response stalls on a client that does not read.
        prompt = [LONG_TOKEN_ID] * (MAX_MODEL_LEN - 12)
        body = json.dumps(
            {
                "prompt": [prompt] * (MAX_SEQS // 4),
                "n": 4,
                "max_tokens": 10,
                "ignore_eos": True,
                "logprobs": 20,
                "echo": True,
                "stream": True,
            }
        ).encode()
        reader, writer = await _connect(server.port, rcvbuf=4096)
        writer.write(request_head("POST", "/v1/completions", len(body)) + body)
        await writer.drain()
        status, _ = await read_head(reader)
        assert status == 200
        # ... and never read more: every slot is taken until the idle timeout
        assert await _served_within(server.port, 90) == 200
        idle = await wait_idle(server.port)
        assert idle["asyncllm:num_requests_running"] == 0
        assert idle["asyncllm:kv_cache_usage_perc"] == 0
        # the server closed the connection: none of its sockets is still open
        deadline = time.monotonic() + CUT_OFF_WITHIN_S
        while open_server_sockets(server.port) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert open_server_sockets(server.port) == []
        writer.close()
        # every slot is free again: all sequences at once
        both = await post_json(server.port, "/v1/completions", {**SMALL, "n": MAX_SEQS})
        assert both.status == 200, both.body

    asyncio.run(run())


def test_connections_past_the_cap_are_refused_then_served(server):
    async def attempt() -> bool | None:
        """True: refused while the cap was full; None: the idle connections
        timed out before the check could be made (a stalled machine)."""
        start = time.monotonic()
        idle = [await _connect(server.port) for _ in range(MAX_CONNECTIONS)]
        try:
            reply = await request(server.port, "GET", "/health", timeout=CUT_OFF_WITHIN_S)
            refused = reply.status == 503
        except (ConnectionError, asyncio.IncompleteReadError):
            refused = True  # closed without an answer also refuses
        in_time = time.monotonic() - start < TIMEOUT_S
        for reader, _ in idle:  # the idle ones are cut off by the header timeout
            closed, _ = await is_closed_by_server(reader, CUT_OFF_WITHIN_S)
            assert closed
        for _, writer in idle:
            writer.close()
        return refused if in_time else None

    async def run() -> None:
        for _ in range(3):
            refused = await attempt()
            if refused is not None:
                break
        assert refused is True
        assert (await request(server.port, "GET", "/health")).status == 200

    asyncio.run(run())


def test_no_slow_client_left_a_traceback_in_the_log(server):
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert "ERROR" not in log, log[-4000:]
