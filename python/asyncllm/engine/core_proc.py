"""EngineCore in its own process: the busy loop and its two IO threads.

    input thread   recv frame -> decode (Rust, GIL released) -> validate and hash
                   the prompt's blocks -> input queue
    busy loop      drain inputs (block only when idle) -> schedule -> execute ->
                   update -> hand the step's outputs to the output queue (with
                   async_scheduling: the model runs on a runner thread while the
                   loop plans the next step, see asyncllm.engine.overlap)
    output thread  encode (Rust, GIL released) -> send

Run as `python -m asyncllm.engine.core_proc` by the front end's launcher (a fresh
interpreter, so user scripts need no `__main__` guard), or in a thread of the
front end's process over `inproc://` sockets for debugging. The first frame it
sends is READY or, when start-up fails, ENGINE_ERROR with the root cause.

Failure is all or nothing: an exception (or a Rust panic, a `BaseException`) in
any of the three threads sends one ENGINE_ERROR frame naming the thread and the
cause, stops the busy loop, and ends the process with status 1, so every request
waiting in the front end fails at once instead of hanging. The process ignores
SIGINT and SIGTERM (a signal to the whole process group must not end it before
the front end has drained): it leaves on SHUTDOWN, or when its parent dies.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import queue
import signal
import sys
import threading
import traceback
from typing import Any

import zmq

from asyncllm import _core, curve, envs
from asyncllm.config import EngineArgs
from asyncllm.core.request import Request
from asyncllm.curve import ClientKeys
from asyncllm.engine.core import EngineCore, build_engine_core
from asyncllm.engine.overlap import OverlapStepper
from asyncllm.engine.step_timers import StepTimers
from asyncllm.engine.utility_calls import utility_calls
from asyncllm.engine.wire import from_wire
from asyncllm.errors import AsyncLLMError
from asyncllm.messages import StepOutputs
from asyncllm.tracing import Tracer, now_ns

logger = logging.getLogger(__name__)

# Bounded queues: a consumer that falls behind stalls the producer instead of
# growing memory. Outputs are one frame per step, so 64 is ample slack.
_INPUT_QUEUE_SIZE = 4096
_OUTPUT_QUEUE_SIZE = 64
_SEND_HWM = 256
_LINGER_MS = 2000
_QUEUE_POLL_S = 0.1  # how often a thread blocked on a full queue checks for failure


class _Stop:
    """Sentinel that ends the output thread."""


class EngineCoreProc:
    """Owns the engine core, its sockets and threads. `run_busy_loop` runs on the
    thread that built it and returns after a SHUTDOWN message."""

    def __init__(
        self,
        args: EngineArgs,
        input_addr: str,
        output_addr: str,
        context: zmq.Context | None = None,
        keys: ClientKeys | None = None,
    ) -> None:
        self.args = args
        self.ctx = context or zmq.Context.instance()
        self._keys = keys  # CURVE keys where the front end is reached over TCP (Ray)
        self.input_queue: queue.Queue[tuple[Any, ...]] = queue.Queue(_INPUT_QUEUE_SIZE)
        self.output_queue: queue.Queue[Any] = queue.Queue(_OUTPUT_QUEUE_SIZE)
        self._tracer: Tracer | None = None  # the core's, once it is built
        self._shutdown = False
        # The first failure of any thread; once set, the busy loop stops.
        self.failure: BaseException | None = None
        self._failure_lock = threading.Lock()
        self.core: EngineCore | None = None
        # The output thread comes first, so a start-up failure can still be reported.
        self._output_thread = threading.Thread(
            target=self._output_loop, args=(output_addr,), name="core-output", daemon=True
        )
        self._output_thread.start()
        try:
            self.core = build_engine_core(args)
        except BaseException as exc:
            self._put_output(_core.encode_engine_error(_describe(exc)))
            self.close()
            raise
        core = self.core
        self._tracer = core.tracer
        # the hand-off's timers, and the utility calls the front end may make
        self.timers = StepTimers(core)
        self.utilities = utility_calls(core, self.timers)
        ready = _core.Ready(
            max_model_len=core.config.max_model_len,
            num_kv_blocks=core.num_kv_blocks,
            block_size=core.config.block_size,
            vocab_size=core.vocab_size,
            eos_token_ids=sorted(core.eos_token_ids),
            hidden_size=core.hidden_size,
        )
        # Everything built so far (the model, torch's modules) lives as long as the
        # process: keep it out of the cyclic GC, whose full collections would
        # otherwise walk it and stall the busy loop for many milliseconds.
        gc.collect()
        gc.freeze()
        self.output_queue.put(_core.encode_ready(ready))
        self._input_thread = threading.Thread(
            target=self._input_loop, args=(input_addr,), name="core-input", daemon=True
        )
        self._input_thread.start()

    # -- the busy loop (main thread) -----------------------------------------------

    def run_busy_loop(self) -> None:
        """Step until SHUTDOWN or a failure (then `self.failure` is set and the
        front end has been told)."""
        try:
            self._busy_loop()
        except BaseException as exc:
            self._fail(exc, "busy loop")

    def _busy_loop(self) -> None:
        core = self.core
        assert core is not None
        if core.config.async_scheduling:
            self._overlap_loop(core)
            return
        has_unfinished = core.scheduler.has_unfinished_requests
        pending_inputs = self.input_queue.queue  # its deque: read without the lock
        while not self._shutdown:
            if pending_inputs or not has_unfinished():
                self._process_inputs(block=not has_unfinished())
                if self._shutdown or not has_unfinished():
                    continue
            outputs = core.step()
            if outputs.req_ids:
                self._hand_off(outputs)

    def _overlap_loop(self, core: EngineCore) -> None:
        """The busy loop with overlap scheduling (asyncllm.engine.overlap): the
        model runs on the runner thread; a failure there ends the loop with a
        RunnerFailedError, reported like any failure of the loop."""
        stepper = self.timers.stepper = OverlapStepper(core)
        has_unfinished = core.scheduler.has_unfinished_requests
        pending_inputs = self.input_queue.queue
        try:
            while not self._shutdown:
                if pending_inputs or not (stepper.busy or has_unfinished()):
                    self._process_inputs(block=not (stepper.busy or has_unfinished()))
                    if self._shutdown or not (stepper.busy or has_unfinished()):
                        continue
                outputs = stepper.step()
                if outputs is not None and outputs.req_ids:
                    self._hand_off(outputs)
        finally:
            stepper.close()

    def _hand_off(self, outputs: StepOutputs) -> None:
        """Queue a step's outputs for the output thread (waiting, counted as
        back-pressure, when the front end lags)."""
        self.timers.hand_off(outputs, self.output_queue.put_nowait, self._put_output)

    def _process_inputs(self, block: bool) -> None:
        q = self.input_queue
        if block:
            self._handle(q.get())
        while not self._shutdown:
            try:
                item = q.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: tuple[Any, ...]) -> None:
        core = self.core
        assert core is not None
        kind = item[0]
        if kind == "add":
            _, requests, rejected = item
            for request in requests:
                if core.scheduler.id_in_use(request.request_id):
                    rejected.append((request.request_id, "duplicate wire id"))
                else:
                    core.add_request(request)
            if rejected:
                ids = [rid for rid, _ in rejected]
                errors: list[str | None] = [msg for _, msg in rejected]
                self._put_output(core.final_outputs(ids, "error", errors))
        elif kind == "abort":
            outputs = core.abort_requests(item[1])
            if outputs.req_ids:
                self._put_output(outputs)
        elif kind == "utility":
            _, call_id, method, args = item
            try:
                value = self._call_utility(method, args)
                result = _core.encode_utility_result(call_id, True, value)
            except Exception as exc:  # a failed utility call fails that call only
                logger.warning("utility call %s failed: %s", method, exc)
                result = _core.encode_utility_result(call_id, False, str(exc))
            self._put_output(result)
        elif kind == "shutdown":
            self._shutdown = True
        # "wake" (from `_fail`) only unblocks the loop, which then sees `_shutdown`.

    def _call_utility(self, method: str, args: Any) -> Any:
        call = self.utilities.get(method)
        if call is None:
            raise ValueError(f"unknown utility method {method!r}")
        return call(args)

    # -- IO threads ---------------------------------------------------------------

    def _input_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        if self._keys is not None:
            curve.connect(sock, self._keys)
        sock.connect(addr)
        core = self.core
        assert core is not None
        put = self._put_input
        try:
            while not self._shutdown:
                frame = sock.recv(copy=True)
                try:
                    msg_type, payload = _core.decode_message(frame)
                except _core.WireError as exc:
                    logger.warning("dropped a malformed frame (%d bytes): %s", len(frame), exc)
                    continue
                if msg_type == _core.MSG_ADD_REQUESTS:
                    requests: list[Request] = []
                    rejected: list[tuple[int, str]] = []
                    for add in payload:
                        try:  # validation and prompt block hashing: off the busy loop
                            requests.append(core.make_request(from_wire(add)))
                        except AsyncLLMError as exc:
                            rejected.append((add.wire_id, str(exc)))
                    put(("add", requests, rejected))
                elif msg_type == _core.MSG_ABORT:
                    put(("abort", payload))
                elif msg_type == _core.MSG_UTILITY_CALL:
                    put(("utility", *payload))
                elif msg_type == _core.MSG_SHUTDOWN:
                    put(("shutdown",))
                    return
                else:
                    logger.warning("dropped an unexpected message of type %d", msg_type)
        except zmq.ContextTerminated:
            return
        except BaseException as exc:  # BaseException: a Rust panic is not an Exception
            self._fail(exc, "input thread")
        finally:
            sock.close()

    def _output_loop(self, addr: str) -> None:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, _SEND_HWM)
        sock.setsockopt(zmq.LINGER, _LINGER_MS)
        if self._keys is not None:
            curve.connect(sock, self._keys)
        sock.connect(addr)
        get = self.output_queue.get
        try:
            while True:
                item = get()
                if item is _Stop:
                    return
                tracer = self._tracer
                if tracer is not None:
                    t0 = now_ns()
                frame = item.encode() if isinstance(item, StepOutputs) else item
                if tracer is not None:
                    t1 = now_ns()
                sock.send(frame, copy=False)
                if tracer is not None:
                    args = {"bytes": len(frame)}
                    tracer.complete("encode", t0, t1, args)
                    tracer.complete("send", t1, now_ns(), args)
        except zmq.ContextTerminated:
            return
        except BaseException as exc:
            # This thread is the one that reports failures: report its own here.
            with contextlib.suppress(zmq.ZMQError):
                sock.send(_core.encode_engine_error(_failure_text(exc, "output thread")))
            self._fail(exc, "output thread", report=False)
        finally:
            sock.close()

    # -- failure and hand-offs ------------------------------------------------------

    def _fail(self, exc: BaseException, thread: str, report: bool = True) -> None:
        """Any thread, on an exception it cannot recover from: tell the front end
        (ENGINE_ERROR) and stop the busy loop. The first failure wins."""
        with self._failure_lock:
            if self.failure is not None:
                return
            self.failure = exc
        logger.error("engine core %s failed", thread, exc_info=exc)
        if report:
            self._put_output(_core.encode_engine_error(_failure_text(exc, thread)))
        self._shutdown = True
        with contextlib.suppress(queue.Full):  # if full, the loop is not blocked on it
            self.input_queue.put_nowait(("wake",))

    def _put_output(self, item: Any, timeout: float | None = None) -> None:
        """Queue an item for the output thread, waiting while the queue is full
        (back-pressure), but never for a dead output thread (or past `timeout`)."""
        q = self.output_queue
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            pass
        waited = 0.0
        while self._output_thread.is_alive() and (timeout is None or waited < timeout):
            try:
                q.put(item, timeout=_QUEUE_POLL_S)
                return
            except queue.Full:
                waited += _QUEUE_POLL_S

    def _put_input(self, item: tuple[Any, ...]) -> None:
        """Input thread: queue for the busy loop, waiting while the queue is full,
        but not for a busy loop that has stopped."""
        q = self.input_queue
        try:
            q.put_nowait(item)
            return
        except queue.Full:
            pass
        while not self._shutdown:
            try:
                q.put(item, timeout=_QUEUE_POLL_S)
                return
            except queue.Full:
                pass

    def close(self) -> None:
        """Flush what is queued for the front end and stop the output thread."""
        limit = _LINGER_MS / 1000 + 1
        self._put_output(_Stop, timeout=limit)
        self._output_thread.join(timeout=limit)
        if self.core is not None:
            self.core.close()


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _failure_text(exc: BaseException, thread: str) -> str:
    return f"the engine core's {thread} failed: {_describe(exc)}"


def _watch_parent() -> None:
    """Exit when the front end goes away: it holds the write end of our stdin, so
    EOF here means it has died (or closed it on purpose). No orphans."""
    # os.read, not sys.stdin: a buffered reader's lock held by this daemon thread
    # would abort the interpreter's shutdown.
    try:
        while os.read(0, 1024):
            pass
    except OSError:
        pass
    logger.info("front-end process is gone; engine core exiting")
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m asyncllm.engine.core_proc")
    ap.add_argument("--engine-args", required=True, help="EngineArgs as JSON")
    ap.add_argument("--input", required=True, help="ZMQ address to receive requests on")
    ap.add_argument("--output", required=True, help="ZMQ address to send outputs to")
    ap.add_argument("--watch-stdin", action="store_true", help="exit when stdin closes")
    opts = ap.parse_args(argv)
    logging.basicConfig(
        level=envs.log_level(),
        format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s",
    )
    # Ctrl-C, systemd's stop and `kill -- -PGID` reach the whole process group: the
    # front end decides, drains its requests, then sends SHUTDOWN. If it dies
    # instead, `_watch_parent` ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if opts.watch_stdin:
        threading.Thread(target=_watch_parent, name="parent-watch", daemon=True).start()
    proc = None
    try:
        keys = curve.take_client_keys()
        proc = EngineCoreProc(
            EngineArgs.from_json(opts.engine_args), opts.input, opts.output, keys=keys
        )
        proc.run_busy_loop()  # reports its own failures, and those of the IO threads
        return 0 if proc.failure is None else 1
    except BaseException:  # start-up: the constructor has reported it
        traceback.print_exc()
        return 1
    finally:
        if proc is not None:
            proc.close()
        # Deliver what the output socket still holds (READY's successor or the
        # ENGINE_ERROR frame) before the process ends: term() waits out the linger.
        zmq.Context.instance().term()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter finalisation: everything is closed already, and extension
    # modules loaded by torch report spurious "leaks" while tearing down.
    os._exit(code)
