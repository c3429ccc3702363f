"""A model runner's steps on a thread of their own, for overlap scheduling.

The busy loop submits step N+1 while step N runs and waits for a step's result
only when it needs it. One worker thread runs the steps strictly in submission
order, so each step sees the tokens the previous one sampled (the runner appends
them to its own state). The forward pass releases the GIL (torch ops, the null
runner's sleep), which is what lets the busy loop work meanwhile. An exception
on this thread is re-raised by the busy loop's `result()`, which then fails the
engine like any failure of its own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from threading import get_ident
from typing import Protocol

from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.tracing import now_ns
from asyncllm.worker.runner_output import ModelRunnerOutput

# (the runner's output, the step's start and end on the trace clock (ns), and the
# runner thread's ident, for its spans)
TimedOutput = tuple[ModelRunnerOutput, int, int, int]


class _Runner(Protocol):
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput: ...


class RunnerFailedError(RuntimeError):
    """The model runner raised on its thread; the cause is chained."""


class RunnerThread:
    def __init__(self, runner: _Runner) -> None:
        self._execute = runner.execute_model
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="core-runner")

    def submit(self, so: SchedulerOutput) -> Future[TimedOutput]:
        return self._pool.submit(self._run, so)

    def _run(self, so: SchedulerOutput) -> TimedOutput:
        t0 = now_ns()
        out = self._execute(so)
        return out, t0, now_ns(), get_ident()

    def close(self) -> None:
        """Stop taking steps; a step still queued is cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)
