"""The front end's side of the process boundary: sockets to the engine core, the
READY handshake, a receiver thread, and death detection.

Frames are decoded on the receiver thread (the Rust codec releases the GIL for
the byte work) and handed to the owner through `on_output`; utility calls are
matched to their results by call id. If the core dies, `on_dead` is called once
with an `EngineDeadError` and every pending call fails with it.

Sending never blocks the caller (often the event loop's thread): a frame the
socket will not take now (the core is not reading) waits, in order, in a
backlog that a sender thread delivers. Sending and receiving take different
locks, so a full input pipe can never stop the outputs from being read.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator

from asyncllm import _core, curve
from asyncllm.config import EngineArgs
from asyncllm.engine.launcher import CoreProcess
from asyncllm.engine.ray_launcher import RayCoreProcess, bind_host
from asyncllm.errors import EngineDeadError, EngineStartupError
from asyncllm.tracing import Tracer, now_ns

logger = logging.getLogger(__name__)

_POLL_MS = 100  # how often the receiver looks up from its socket to check for shutdown
_SHUTDOWN_TIMEOUT_S = 5.0
_SEND_RETRY_S = 0.005  # the sender thread's pause while the core's input pipe is full
_ERROR_FRAME_WAIT_S = 1.0  # after the core ended: how long its ENGINE_ERROR may take


class MPClient:
    """A connection to one engine core: in a child process (the default) or, for
    debugging, in a thread of this process over `inproc://` sockets."""

    def __init__(
        self,
        args: EngineArgs,
        on_output: Callable[[_core.OutputBatch], None],
        on_dead: Callable[[EngineDeadError], None],
        *,
        in_thread: bool = False,
        startup_timeout: float = 300.0,
        tracer: Tracer | None = None,
    ) -> None:
        self._on_output = on_output
        self._tracer = tracer  # spans for each frame received (asyncllm.tracing)
        self._on_dead = on_dead
        self._lock = threading.Lock()  # `dead` and `_calls`; never held while sending
        self._send_lock = threading.Condition()  # the input socket and the backlog
        self._backlog: deque[bytes] = deque()
        self._sender: threading.Thread | None = None
        self._calls: dict[int, Future[Any]] = {}
        self._call_ids = itertools.count()
        self._closing = False
        self._closed = False
        self.dead: EngineDeadError | None = None
        self._last_error: str | None = None
        self.ctx = zmq.Context()
        self.process: CoreProcess | RayCoreProcess | None = None
        self._core_thread: threading.Thread | None = None
        self._auth: ThreadAuthenticator | None = None
        keys: curve.ServerKeys | None = None
        if in_thread:
            name = uuid.uuid4().hex
            input_addr, output_addr = f"inproc://{name}-in", f"inproc://{name}-out"
        elif args.data_parallel_backend == "ray":  # over TCP: CURVE on both sockets
            keys = curve.ServerKeys.generate()
            self.process = RayCoreProcess(args, keys.client, bind_host(args))
            self._auth = curve.start_authenticator(self.ctx, keys)
            input_addr, output_addr = self.process.input_addr, self.process.output_addr
        else:
            self.process = CoreProcess(args)
            input_addr, output_addr = self.process.input_addr, self.process.output_addr
        self._input = self.ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        self._output = self.ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        try:
            for sock, addr in ((self._input, input_addr), (self._output, output_addr)):
                if keys is not None:
                    curve.serve(sock, keys)
                sock.bind(addr)
            if isinstance(self.process, RayCoreProcess):  # the ports ZMQ chose
                self.process.input_addr = self._input.getsockopt_string(zmq.LAST_ENDPOINT)
                self.process.output_addr = self._output.getsockopt_string(zmq.LAST_ENDPOINT)
            if self.process is not None:
                self.process.start()
            else:
                self._core_thread = threading.Thread(
                    target=_run_core_in_thread,
                    args=(args, input_addr, output_addr, self.ctx),
                    name="engine-core",
                    daemon=True,
                )
                self._core_thread.start()
            self.ready = self._wait_ready(startup_timeout)
        except BaseException:
            self._teardown()
            raise
        self._receiver = threading.Thread(target=self._receive_loop, name="core-receiver")
        self._receiver.daemon = True
        self._receiver.start()
        threading.Thread(target=self._watch_core, name="core-monitor", daemon=True).start()

    # -- requests -------------------------------------------------------------------

    def add_requests(self, requests: Sequence[_core.AddRequest]) -> None:
        self._send(_core.encode_add_requests(requests))

    def add_request_groups(self, groups: Sequence[Sequence[_core.AddRequest]]) -> None:
        """Many prompts' requests in one message: the core admits them together."""
        self.add_requests([r for g in groups for r in g])

    def abort_requests(self, wire_ids: Sequence[int]) -> None:
        if wire_ids and self.dead is None and not self._closing:
            self._send(_core.encode_abort(wire_ids))

    def call_utility(self, method: str, args: Any = None) -> Future[Any]:
        """Run `method` on the core's busy loop; the future holds its result.
        Cancelling the future (a caller's timeout) forgets the call."""
        future: Future[Any] = Future()
        call_id = next(self._call_ids)
        with self._lock:
            if self.dead is not None:
                future.set_exception(self.dead)
                return future
            self._calls[call_id] = future
        future.add_done_callback(lambda _: self._forget_call(call_id))
        try:
            self._send(_core.encode_utility_call(call_id, method, args))
        except BaseException:
            future.cancel()
            raise
        return future

    def _forget_call(self, call_id: int) -> None:
        with self._lock:
            self._calls.pop(call_id, None)

    @property
    def num_pending_calls(self) -> int:
        """Utility calls waiting for their result."""
        return len(self._calls)

    def send_raw(self, frame: bytes) -> None:
        """Send a frame as is (for tests of the core's robustness)."""
        self._send(frame)

    def _send(self, frame: bytes) -> None:
        """Send now if the socket takes it, else queue it behind the backlog."""
        if self.dead is not None:
            raise self.dead
        if self._closing:
            raise EngineDeadError("the engine has been shut down")
        with self._send_lock:
            if not self._backlog:
                try:
                    self._input.send(frame, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    pass
            self._backlog.append(frame)
            if self._sender is None:
                self._sender = threading.Thread(
                    target=self._send_loop, name="core-sender", daemon=True
                )
                self._sender.start()
            self._send_lock.notify()

    def _send_loop(self) -> None:
        """Sender thread: deliver the backlog in order while the core lets it."""
        with self._send_lock:
            while not self._closing and self.dead is None:
                if not self._backlog:
                    self._send_lock.wait()
                    continue
                try:
                    self._input.send(self._backlog[0], flags=zmq.NOBLOCK, copy=False)
                    self._backlog.popleft()
                except zmq.Again:  # still full: let callers in, then try again
                    self._send_lock.wait(_SEND_RETRY_S)
                except zmq.ZMQError:
                    return

    @property
    def num_backlogged(self) -> int:
        """Frames waiting for the core to read its input."""
        return len(self._backlog)

    # -- lifecycle ------------------------------------------------------------------

    def _wait_ready(self, timeout: float) -> _core.Ready:
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        waited = 0.0
        while waited < timeout:
            if poller.poll(_POLL_MS):
                msg_type, payload = _core.decode_message(self._output.recv())
                if msg_type == _core.MSG_READY:
                    return payload  # type: ignore[no-any-return]
                if msg_type == _core.MSG_ENGINE_ERROR:
                    raise EngineStartupError(f"the engine core failed to start: {payload}")
                logger.warning("ignored message type %d before READY", msg_type)
                continue
            waited += _POLL_MS / 1000
            code = self.process.exit_code() if self.process else None
            if code is not None:
                raise EngineStartupError(
                    f"the engine core process exited with code {code} before it was ready "
                    "(its error output above says why)"
                )
            if self._core_thread is not None and not self._core_thread.is_alive():
                raise EngineStartupError("the engine core thread ended before it was ready")
        raise EngineStartupError(f"the engine core was not ready within {timeout:.0f}s")

    def _receive_loop(self) -> None:
        sock = self._output
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        tracer = self._tracer
        try:
            while not self._closing:
                if not poller.poll(_POLL_MS):
                    continue
                try:
                    if tracer is not None:
                        t0 = now_ns()
                    frame = sock.recv(copy=False)
                    if tracer is not None:
                        t1 = now_ns()
                    msg_type, payload = _core.decode_message(frame.buffer)
                except zmq.ZMQError:
                    return
                except _core.WireError as exc:
                    logger.error("dropped a malformed frame from the engine core: %s", exc)
                    continue
                if tracer is not None:
                    t2 = now_ns()
                    tracer.complete("receive", t0, t1, {"bytes": len(frame.buffer)})
                    tracer.complete("decode", t1, t2, {"type": msg_type})
                if msg_type == _core.MSG_OUTPUT_BATCH:
                    self._on_output(payload)
                    if tracer is not None:
                        tracer.complete("enqueue", t2, now_ns(), {"outputs": len(payload)})
                elif msg_type == _core.MSG_UTILITY_RESULT:
                    self._complete_call(*payload)
                elif msg_type == _core.MSG_ENGINE_ERROR:
                    self._last_error = str(payload)
                    logger.error("engine core reported a fatal error: %s", payload)
                    self._die(f"the engine core failed: {payload}")
        except BaseException as exc:  # a lost batch would hang its requests: fail all
            logger.exception("the front end's receiver failed")
            self._die(f"the front end's receiver failed: {type(exc).__name__}: {exc}")

    def _complete_call(self, call_id: int, ok: bool, value: Any) -> None:
        with self._lock:
            future = self._calls.pop(call_id, None)
        if future is None:  # timed out and forgotten
            return
        with contextlib.suppress(InvalidStateError):  # cancelled meanwhile
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(f"engine core utility call: {value}"))

    def _watch_core(self) -> None:
        """Monitor thread: the core's process (or thread) ending while not asked
        to is its death, reported with its ENGINE_ERROR text when that came."""
        if self.process is not None:
            code = self.process.wait()
            what = f"the engine core process exited unexpectedly with code {code}"
            reported = code > 0  # it failed and said why; a signal leaves no word
        else:
            assert self._core_thread is not None
            self._core_thread.join()
            what, reported = "the engine core thread ended unexpectedly", True
        deadline = time.monotonic() + _ERROR_FRAME_WAIT_S
        while reported and self.dead is None and not self._closing:
            if time.monotonic() > deadline:  # its ENGINE_ERROR frame may still be in flight
                break
            time.sleep(_POLL_MS / 1000 / 4)
        if not self._closing:
            detail = f": {self._last_error}" if self._last_error else ""
            self._die(what + detail)

    def _die(self, message: str) -> None:
        error = EngineDeadError(message)
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(error)
        self._on_dead(error)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and not self._closing

    def shutdown(self) -> None:
        """Stop the core and release every resource. Idempotent; never raises."""
        if self._closed:
            return
        self._closing = True
        try:
            with self._send_lock:
                self._send_lock.notify_all()  # the sender thread leaves
                if self.dead is None:
                    self._input.send(_core.encode_shutdown(), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        receiver = getattr(self, "_receiver", None)
        if receiver is not None:
            receiver.join(timeout=2 * _POLL_MS / 1000 + 1)
        self._teardown()
        with self._lock:
            calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(EngineDeadError("the engine has been shut down"))

    def _teardown(self) -> None:
        self._closing = True
        if self.process is not None:
            self.process.stop(timeout=_SHUTDOWN_TIMEOUT_S)
        if self._core_thread is not None:
            self._core_thread.join(timeout=_SHUTDOWN_TIMEOUT_S)
        with self._send_lock:
            self._send_lock.notify_all()
        if self._sender is not None:
            self._sender.join(timeout=1.0)
        self._input.close(linger=0)
        self._output.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()
        self._closed = True


def _run_core_in_thread(args: EngineArgs, input_addr: str, output_addr: str, ctx: Any) -> None:
    from asyncllm.engine.core_proc import EngineCoreProc

    proc = None
    try:
        proc = EngineCoreProc(args, input_addr, output_addr, context=ctx)
        proc.run_busy_loop()  # reports its failures (and its threads') through the socket
    except BaseException:  # start-up: reported through the socket by the constructor
        logger.exception("engine core thread failed to start")
    finally:
        if proc is not None:
            proc.close()
