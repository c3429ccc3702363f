"""Rank 0 <-> workers on other machines: the rendezvous store and the workers' status,
over one ZMQ socket secured with CURVE (the Ray executor's; executor/ray_executor.py).

Between machines the multiprocess executor's FileStore and status pipe do not reach,
and torch's TCPStore cannot serve instead: its server listens on every interface
whatever host it is given (it binds "::"; checked with torch 2.15) and lets anyone
read and write the group's keys. Here rank 0 binds one ROUTER socket to the address
given (never all interfaces) as a CURVE server whose ZAP handler admits only the
workers' key, made at start-up and handed to them through Ray (curve.py). Each
worker connects two DEALER sockets: one for its status bytes (worker_proc's pipe
protocol: b"R", b"H" heartbeats, b"E" + length + text), one for its `dist.Store`
calls. No pickle: frames are raw bytes and UTF-8 keys.

    status   [b"T", rank (4 bytes, little-endian), status bytes]
    request  [b"Q", request id (8 bytes), op, args...]
    reply    [request id, b"0" + value | b"1" + error text]

The store's values live in rank 0 (`StoreTable`). A `get` or `wait` of a key not
yet set is parked and answered when it is; the caller's side bounds the wait.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
import zmq

from asyncllm import curve

STORE_TIMEOUT = timedelta(seconds=300)  # a rendezvous key not set by then is an error
_MAX_PARKED = 10_000
_LINGER_MS = 2000  # a worker's last status (its error) is flushed before it exits

SET, GET, ADD, CHECK, WAIT, COMPARE_SET, DELETE, NUM_KEYS = (
    b"S",
    b"G",
    b"A",
    b"C",
    b"W",
    b"X",
    b"D",
    b"N",
)


class StoreTable:
    """The store's data (in rank 0). `apply` runs one operation; for `get` and
    `wait` of keys not set yet it returns None (the caller waits and retries)."""

    def __init__(self) -> None:
        self.data: dict[bytes, bytes] = {}  # keys as the callers' UTF-8 bytes
        self.version = 0  # bumped by every write: parked reads are retried then
        self.cond = threading.Condition()

    def apply(self, op: bytes, args: Sequence[bytes]) -> bytes | None:
        with self.cond:
            return self._apply(op, [bytes(a) for a in args])

    def _apply(self, op: bytes, args: list[bytes]) -> bytes | None:
        data = self.data
        keys = args
        if op == GET:
            return data.get(keys[0])
        if op == WAIT:
            return b"" if all(k in data for k in keys) else None
        if op == CHECK:
            return b"1" if all(k in data for k in keys) else b"0"
        if op == NUM_KEYS:
            return str(len(data)).encode()
        if op == SET:
            data[keys[0]] = args[1]
        elif op == ADD:
            data[keys[0]] = str(int(data.get(keys[0], b"0")) + int(args[1])).encode()
        elif op == COMPARE_SET:  # c10d's: set when the key holds `expected` (or is
            # absent and `expected` is empty); return what the key holds after
            current = data.get(keys[0])
            if (current is None and not args[1]) or current == args[1]:
                data[keys[0]] = args[2]
            return data.get(keys[0], args[1])
        elif op == DELETE:
            found = data.pop(keys[0], None) is not None
            self._written()
            return b"1" if found else b"0"
        else:
            raise ValueError(f"unknown store operation {op!r}")
        self._written()
        return data[keys[0]] if op == ADD else b""

    def _written(self) -> None:
        self.version += 1
        self.cond.notify_all()


def _text(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class _Store(dist.Store):
    """The `dist.Store` calls, on an `_call(op, args, timeout)` of the subclass's."""

    def __init__(self) -> None:
        super().__init__()  # the pybind trampoline needs it

    def _call(self, op: bytes, args: Sequence[bytes], timeout: timedelta) -> bytes:
        raise NotImplementedError

    def set(self, key: str, value: str | bytes) -> None:  # type: ignore[override]
        self._call(SET, (_text(key), _text(value)), STORE_TIMEOUT)

    def get(self, key: str) -> bytes:
        return self._call(GET, (_text(key),), STORE_TIMEOUT)

    def add(self, key: str, value: int) -> int:
        return int(self._call(ADD, (_text(key), str(int(value)).encode()), STORE_TIMEOUT))

    def check(self, keys: list[str]) -> bool:
        return self._call(CHECK, [_text(k) for k in keys], STORE_TIMEOUT) == b"1"

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._call(WAIT, [_text(k) for k in keys], timeout or STORE_TIMEOUT)

    def compare_set(  # type: ignore[override]
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        args = (_text(key), _text(expected_value), _text(desired_value))
        return self._call(COMPARE_SET, args, STORE_TIMEOUT)

    def delete_key(self, key: str) -> bool:
        return self._call(DELETE, (_text(key),), STORE_TIMEOUT) == b"1"

    def num_keys(self) -> int:
        return int(self._call(NUM_KEYS, (), STORE_TIMEOUT))


class LocalStore(_Store):
    """Rank 0's store: the table itself, in this process. A wait gives up as soon
    as `abort()` returns a reason (a worker failed: it will never set its keys)."""

    def __init__(self, table: StoreTable, abort: Callable[[], str | None] = lambda: None) -> None:
        super().__init__()
        self._table = table
        self._abort = abort

    def _call(self, op: bytes, args: Sequence[bytes], timeout: timedelta) -> bytes:
        table = self._table
        deadline = time.monotonic() + timeout.total_seconds()
        with table.cond:
            while (value := table._apply(op, list(args))) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LookupError(f"rendezvous key(s) {_names(args)} not set in {timeout}")
                if (reason := self._abort()) is not None:
                    raise RuntimeError(reason)
                table.cond.wait(min(left, 0.1))
        return value


class RemoteStore(_Store):
    """A worker's store: requests to rank 0's hub over its own DEALER socket."""

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        super().__init__()
        self._sock = sock
        self._ids = itertools.count()
        self._lock = threading.Lock()  # one request at a time on the socket

    def _call(self, op: bytes, args: Sequence[bytes], timeout: timedelta) -> bytes:
        with self._lock:
            rid = next(self._ids).to_bytes(8, "little")
            self._sock.send_multipart([b"Q", rid, op, *args])
            deadline = time.monotonic() + timeout.total_seconds()
            while (left := deadline - time.monotonic()) > 0:
                if not self._sock.poll(int(min(left, 1.0) * 1000) + 1):
                    continue
                reply = self._sock.recv_multipart()
                if len(reply) != 2 or reply[0] != rid:
                    continue  # the late answer to a request that timed out
                if reply[1][:1] != b"0":
                    raise RuntimeError(f"rendezvous store: {reply[1][1:].decode(errors='replace')}")
                return reply[1][1:]
        raise LookupError(f"rendezvous key(s) {_names(args)}: no answer from rank 0 in {timeout}")


def _names(args: Sequence[bytes]) -> str:
    return ", ".join(bytes(a[:100]).decode(errors="replace") for a in args[:1])


class Hub:
    """Rank 0's socket: serves the store and hands the workers' status messages to
    `on_status(rank, data)`. One thread calls `poll` (the executor's watchdog);
    `close` after that thread has stopped."""

    def __init__(self, host: str, size: int, on_status: Callable[[int, bytes], None]) -> None:
        self.size = size
        self.table = StoreTable()
        self.keys = curve.ServerKeys.generate()
        self._on_status = on_status
        self._parked: list[tuple[bytes, bytes, bytes, list[bytes]]] = []
        self._seen_version = 0
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._auth = curve.start_authenticator(self.ctx, self.keys)
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve.serve(self.sock, self.keys)
        self.sock.setsockopt(zmq.IPV6, ":" in host)
        try:
            self.sock.bind(f"tcp://{_bracket(host)}:*")
        except zmq.ZMQError as exc:
            self.close()
            raise OSError(
                f"cannot listen on {host!r} for the tensor-parallel workers: {exc}"
            ) from exc
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def poll(self, timeout_ms: int) -> None:
        """Serve what has arrived (waiting up to `timeout_ms` for it), and any
        parked read that a write has made answerable."""
        sock = self.sock
        if sock.poll(timeout_ms):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                self._handle(frames)
        if self._parked and self.table.version != self._seen_version:
            self._seen_version = self.table.version
            parked, self._parked = self._parked, []
            for ident, rid, op, args in parked:
                self._answer(ident, rid, op, args)

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) == 4 and frames[1] == b"T" and len(frames[2]) == 4:
            rank = int.from_bytes(frames[2], "little")
            if 0 < rank < self.size:
                self._on_status(rank, frames[3])
        elif len(frames) >= 4 and frames[1] == b"Q" and len(frames[2]) == 8:
            self._answer(frames[0], frames[2], frames[3], frames[4:])

    def _answer(self, ident: bytes, rid: bytes, op: bytes, args: list[bytes]) -> None:
        try:
            value = self.table.apply(op, args)
        except Exception as exc:  # a malformed request: the worker's call fails
            self.sock.send_multipart([ident, rid, b"1" + str(exc).encode()])
            return
        if value is None:
            if len(self._parked) < _MAX_PARKED:
                self._parked.append((ident, rid, op, args))
            return
        self.sock.send_multipart([ident, rid, b"0" + value])

    def close(self) -> None:
        self.sock.close(linger=0)
        self._auth.stop()
        self.ctx.term()


class HubLink:
    """A worker's end: its status bytes and its store, to rank 0's hub."""

    def __init__(self, endpoint: str, keys: curve.ClientKeys, rank: int) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self._rank = rank.to_bytes(4, "little")
        self._lock = threading.Lock()  # the heartbeat thread and the main thread write
        self._closed = False
        self._status = self._connect(endpoint, keys)
        self.store = RemoteStore(self._connect(endpoint, keys))

    def _connect(self, endpoint: str, keys: curve.ClientKeys) -> zmq.Socket[Any]:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        curve.connect(sock, keys)
        sock.setsockopt(zmq.IPV6, endpoint.startswith("tcp://["))
        sock.connect(endpoint)
        return sock

    def send(self, data: bytes) -> None:
        """Queue `data` for rank 0; never blocks (what the queue will not take while
        rank 0 is unreachable is dropped: heartbeats, whose absence says it all)."""
        with self._lock:
            if self._closed:
                return
            try:
                self._status.send_multipart([b"T", self._rank, data], zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        """Flush the last status (up to `_LINGER_MS`) and close."""
        with self._lock:
            self._closed = True
            self.ctx.destroy(linger=_LINGER_MS)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
