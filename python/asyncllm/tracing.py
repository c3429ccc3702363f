"""Per-step timelines: Chrome trace-event JSON that Perfetto (ui.perfetto.dev) and
chrome://tracing open, and torch's profiler over a window of engine steps.

Each process that traces (the engine core, the front end) owns one `Tracer` and
writes one file, `<role>-<pid>.json`, holding "X" (complete) events with
timestamps in microseconds. Every process reads the same clock,
`time.monotonic_ns()`: on Linux that is CLOCK_MONOTONIC, one clock for the whole
system, so the core's and the front end's events line up on one timeline.
(`perf_counter` is CLOCK_MONOTONIC on Linux too, but Python promises it only as
a per-process clock with an arbitrary origin.)

Tracing is off unless `EngineArgs.trace_dir` (or ASYNCLLM_TRACE_DIR) is set; the
hot paths then hold `None` and test it once per hook, with no call and no clock
read. When on, events wait in a bounded buffer (the most recent `MAX_EVENTS`;
older ones are dropped) that a background thread writes out every few seconds
and `close` writes at shutdown, each time whole and atomically (a temporary file
renamed over the old one), so even a crashed run leaves a readable file.

`StepRecorder` is what the engine core's step and the model runner call: it
feeds the tracer, the step timers of the benchmarks and, while a profile runs,
torch's `record_function` ranges, from the same few hooks. The model runner's
phases wear the `phase` decorator, which costs one check when no recorder is set.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from threading import get_ident
from typing import Any, TypeVar, cast

from asyncllm.errors import ConfigError

logger = logging.getLogger(__name__)

now_ns = time.monotonic_ns  # the one clock of every trace (see the module docstring)

MAX_EVENTS = 200_000
FLUSH_INTERVAL_S = 5.0
MAX_PROFILE_STEPS = 2_000  # a profile window stops by itself after this many steps

# (name, start ns, duration ns, Python thread ident, args or None)
Event = tuple[str, int, int, int, dict[str, Any] | None]


class Tracer:
    """One process's trace: `complete` records a span, `flush` writes the file."""

    def __init__(
        self,
        directory: str,
        role: str,
        *,
        max_events: int = MAX_EVENTS,
        flush_interval_s: float = FLUSH_INTERVAL_S,
    ) -> None:
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"EngineArgs.trace_dir={directory!r} is invalid: cannot create it ({exc})"
            ) from None
        self.role = role
        self.pid = os.getpid()
        self.path = os.path.join(directory, f"{role}-{self.pid}.json")
        # deque.append is atomic under the GIL: any thread may record, lock-free.
        self.events: deque[Event] = deque(maxlen=max_events)
        self._thread_ids: dict[int, int] = {}  # Python's thread ident -> the OS's
        self._thread_names: dict[int, str] = {}
        self._write_lock = threading.Lock()
        self._closed = threading.Event()
        self._flusher = threading.Thread(
            target=self._flush_loop, args=(flush_interval_s,), name=f"trace-{role}", daemon=True
        )
        self._flusher.start()
        # a last write at interpreter exit for owners that never call close (an
        # in-process engine core under LLM(multiprocess=False))
        atexit.register(self.close)

    def complete(self, name: str, t0: int, t1: int, args: dict[str, Any] | None = None) -> None:
        """A span from `t0` to `t1` (`now_ns()` values) on the calling thread."""
        # get_ident is pthread_self (tens of ns); the OS thread id (a syscall) is
        # looked up at flush time
        self.events.append((name, t0, t1 - t0, get_ident(), args))

    @contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        """A span around a block: for paths that are not per step."""
        t0 = now_ns()
        try:
            yield
        finally:
            self.complete(name, t0, now_ns(), args or None)

    def flush(self) -> None:
        """Write every buffered event to the file, whole and atomically."""
        with self._write_lock:
            for t in threading.enumerate():  # the threads' OS ids and names
                if t.ident is not None and t.native_id is not None:
                    self._thread_ids[t.ident] = t.native_id
                    self._thread_names[t.native_id] = t.name
            events = _snapshot(self.events)
            pid, tids = self.pid, self._thread_ids
            out: list[dict[str, Any]] = [
                {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": self.role}},
            ]
            out += [
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": n}}
                for tid, n in self._thread_names.items()
            ]
            for name, t0, dur, tid, args in events:
                e = {"ph": "X", "name": name, "pid": pid, "tid": tids.get(tid, tid), "ts": t0 / 1e3}
                e["dur"] = dur / 1e3
                if args:
                    e["args"] = args
                out.append(e)
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump({"traceEvents": out, "displayTimeUnit": "ms"}, f)
            os.replace(tmp, self.path)

    def close(self) -> None:
        """Stop the background writer and write the file one last time."""
        if self._closed.is_set():
            return
        self._closed.set()
        atexit.unregister(self.close)
        self._flusher.join(timeout=5.0)
        try:
            self.flush()
        except OSError as exc:
            logger.warning("could not write the trace %s: %s", self.path, exc)

    def _flush_loop(self, interval: float) -> None:
        while not self._closed.wait(interval):
            t0 = now_ns()
            try:
                self.flush()
            except OSError as exc:
                logger.warning("could not write the trace %s: %s", self.path, exc)
                continue
            # the write itself, so a reader can tell it from the engine's own work
            self.complete("trace_flush", t0, now_ns())


def _snapshot(events: deque[Event]) -> list[Event]:
    """A copy of a deque other threads append to: `list()` runs in C without
    giving up the GIL, so it sees no append; retried should that ever change."""
    for _ in range(10):
        try:
            return list(events)
        except RuntimeError:  # mutated during iteration
            continue
    return []


class TorchProfiler:
    """torch.profiler over a window of engine steps (CPU, and CUDA when there is
    one), started and stopped by the core's `start_profile`/`stop_profile`
    utilities; the trace goes to `directory` as `core-<pid>-profile-<n>.json`."""

    def __init__(self, directory: str, max_steps: int = MAX_PROFILE_STEPS) -> None:
        self.directory = directory
        self.max_steps = max_steps
        self.num_steps = 0
        self._profile: Any = None
        self._count = 0
        self.last: dict[str, Any] | None = None  # the result of the last window

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if self._profile is not None:
            raise ValueError("a profile is already running: stop it first")
        os.makedirs(self.directory, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(ProfilerActivity.CUDA)
        prof = profile(activities=activities)
        prof.start()
        self._profile, self.num_steps, self.last = prof, 0, None

    def stop(self) -> dict[str, Any]:
        """End the window (if still open) and write its trace; returns where."""
        prof = self._profile
        if prof is None:
            if self.last is not None:  # it ended by itself at max_steps
                return self.last
            raise ValueError("no profile is running: start one first")
        self._profile = None
        prof.stop()
        self._count += 1
        path = os.path.join(self.directory, f"core-{os.getpid()}-profile-{self._count}.json")
        prof.export_chrome_trace(path)
        self.last = {"trace": path, "num_steps": self.num_steps}
        return self.last


class StepRecorder:
    """The engine core's step hooks. Exists only while one of its jobs is on:
    a trace (`tracer`), the benchmarks' step timers (`timings`), a profile
    window (`profiler`); otherwise the core and the runner hold None.

    Spans are begun and ended with explicit timestamps, so a phase may end on
    another thread than the step's; the profiler's ranges are per thread."""

    def __init__(
        self,
        tracer: Tracer | None,
        timings: deque[tuple[float, float, float, float, int]] | None,
        profiler: TorchProfiler | None,
    ) -> None:
        self.tracer = tracer
        self.timings = timings
        self.profiler = profiler
        # a plain attribute, read by every hook: the core makes a new recorder
        # when a profile starts or stops, and `end_step` clears it at max_steps
        self.profiling = profiler is not None and profiler.active
        self._ranges = threading.local()
        # the tracer's buffer, appended to directly: a call less per span
        self._append = tracer.events.append if tracer is not None else None

    def begin(self, name: str) -> int:
        """A phase starts now; returns its start for `end`."""
        if self.profiling:
            self._enter_range(name)
        return now_ns()

    def end(self, name: str, t0: int, args: dict[str, Any] | None = None) -> int:
        """The phase begun at `t0` ends now; returns the time."""
        t1 = now_ns()
        if self.profiling:
            self._exit_range()
        if self._append is not None:  # as Tracer.complete
            self._append((name, t0, t1 - t0, get_ident(), args))
        return t1

    def phase(self, ended: str, t0: int, begun: str) -> int:
        """`ended` (begun at `t0`) ends and `begun` starts, now."""
        t1 = now_ns()
        if self.profiling:
            self._exit_range()
            self._enter_range(begun)
        if self._append is not None:
            self._append((ended, t0, t1 - t0, get_ident(), None))
        return t1

    def start_step(self) -> int:
        """A step starts with its first phase, schedule."""
        if self.profiling:
            self._enter_range("step")
            self._enter_range("schedule")
        return now_ns()

    def end_step(
        self, t0: int, t1: int, t2: int, num_reqs: int, num_tokens: int, num_outputs: int
    ) -> None:
        """The step begun at `t0` ends: schedule ran to `t1`, execute to `t2`,
        update (with the outputs' building) to now."""
        t3 = self.end("update", t2)
        if self.profiling:
            self._exit_range()  # the step's
            self.count_profiled_step()
        if self.tracer is not None:
            args = {"batch": num_reqs, "tokens": num_tokens, "outputs": num_outputs}
            self.tracer.complete("step", t0, t3, args)
        if self.timings is not None:
            self.timings.append(
                (t0 / 1e9, (t1 - t0) / 1e9, (t2 - t1) / 1e9, (t3 - t2) / 1e9, num_outputs)
            )

    def count_profiled_step(self) -> None:
        """One more step in the profile window; the window closes itself at its
        limit (a forgotten /stop_profile does not grow without bound)."""
        prof = self.profiler
        if not self.profiling or prof is None:
            return
        prof.num_steps += 1
        if prof.num_steps >= prof.max_steps:
            logger.warning("the profile reached %d steps: stopping it", prof.max_steps)
            self.profiling = False
            prof.stop()

    def _enter_range(self, name: str) -> None:
        from torch.profiler import record_function

        stack = getattr(self._ranges, "stack", None)
        if stack is None:
            stack = self._ranges.stack = []
        rf = record_function(name)
        rf.__enter__()
        stack.append(rf)

    def _exit_range(self) -> None:
        stack = getattr(self._ranges, "stack", None)
        if stack:
            stack.pop().__exit__(None, None, None)


_Phase = TypeVar("_Phase", bound=Callable[..., Any])


def phase(
    name: str, args: Callable[[Any], dict[str, Any]] | None = None
) -> Callable[[_Phase], _Phase]:
    """Make a method a traced step phase. Its object holds `recorder` (a
    `StepRecorder`, or None when nothing is recorded): with none the method runs
    after that one check; with one, its call is the span `name`, whose args are
    `args(first argument)` when given."""

    def decorate(method: _Phase) -> _Phase:
        @functools.wraps(method)
        def traced(self: Any, *a: Any) -> Any:
            rec: StepRecorder | None = self.recorder
            if rec is None:
                return method(self, *a)
            t0 = rec.begin(name)
            try:
                return method(self, *a)
            finally:
                rec.end(name, t0, args(a[0]) if args is not None else None)

        return cast(_Phase, traced)

    return decorate
