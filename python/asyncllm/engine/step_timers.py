"""The core process's hand-off timer: what handing a step's outputs to the output
thread costs, and how long a full output queue made the busy loop wait.

The hand-off is timed only while the benchmarks' step timers
(`EngineArgs.collect_step_timings`) or a trace are on: otherwise `hand_off` costs
one check beyond the queue's own `put_nowait`. Back-pressure waits are rare and
always counted. `report` is the `get_step_timings` utility call's answer.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from time import perf_counter
from typing import Any

from asyncllm.engine.core import EngineCore
from asyncllm.engine.overlap import OverlapStepper
from asyncllm.messages import StepOutputs
from asyncllm.tracing import now_ns

_KEEP = 20000  # the most recent steps each timer keeps


class StepTimers:
    """Per step with outputs: the hand-off's cost (`handoff_times`, timed only when
    asked for) and any back-pressure wait (`backpressure_waits`, always)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.handoff_times: deque[float] = deque(maxlen=_KEEP)
        self.backpressure_waits: deque[float] = deque(maxlen=_KEEP)
        self.timed = core.step_timings is not None or core.tracer is not None
        self.stepper: OverlapStepper | None = None  # with async_scheduling, once it runs

    def hand_off(
        self,
        outputs: StepOutputs,
        put_nowait: Callable[[StepOutputs], None],
        put_waiting: Callable[[StepOutputs], None],
    ) -> None:
        """Queue `outputs` with `put_nowait`, or, when the queue is full (the front
        end lags), with `put_waiting`, counting the wait apart from the cost."""
        if not self.timed:
            try:
                put_nowait(outputs)
            except queue.Full:
                self._wait(outputs, put_waiting)
            return
        t0 = now_ns()
        try:
            put_nowait(outputs)
        except queue.Full:
            t0 += int(self._wait(outputs, put_waiting) * 1e9)  # the cost, without the wait
        t1 = now_ns()
        self.handoff_times.append((t1 - t0) / 1e9)
        tracer = self.core.tracer
        if tracer is not None:
            tracer.complete("handoff", t0, t1, {"outputs": len(outputs.req_ids)})

    def _wait(self, outputs: StepOutputs, put_waiting: Callable[[StepOutputs], None]) -> float:
        t0 = perf_counter()
        put_waiting(outputs)
        waited = perf_counter() - t0
        self.backpressure_waits.append(waited)
        return waited

    def report(self, clear: bool) -> dict[str, Any]:
        """Every timer's recent values (the step's from the core, the overlap
        stepper's spans, the hand-off's and back-pressure's from here); `clear`
        empties them after reading. The step and hand-off lists are empty unless
        `collect_step_timings` is on."""
        step_timings = self.core.step_timings
        timings = list(step_timings or ())
        handoff = list(self.handoff_times) if step_timings is not None else []
        backpressure = list(self.backpressure_waits)
        spans = list(self.stepper.spans) if self.stepper is not None else []
        if clear:
            if step_timings is not None:
                step_timings.clear()
            self.handoff_times.clear()
            self.backpressure_waits.clear()
            if self.stepper is not None:
                self.stepper.spans.clear()
        return {
            "collect_step_timings": step_timings is not None,
            # overlap only: per step the forward on the runner thread and the
            # update's end (the core's busy time and wall time)
            "exec_start": [x[0] / 1e9 for x in spans],
            "exec_end": [x[1] / 1e9 for x in spans],
            "end": [x[2] / 1e9 for x in spans],
            "start": [t[0] for t in timings],
            "schedule": [t[1] for t in timings],
            "execute": [t[2] for t in timings],
            "update": [t[3] for t in timings],
            "num_outputs": [t[4] for t in timings],
            "handoff": handoff,
            "backpressure": backpressure,
        }
