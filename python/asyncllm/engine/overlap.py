"""Overlap ("async") scheduling: the engine core with one step in flight.

    busy loop     schedule N+1 -> submit -> wait for N -> update N -> hand off N
    runner thread ........ run N ........ | ........ run N+1 ........

While the runner thread computes step N, the busy loop plans step N+1 (the
`AsyncScheduler` counts each running request's in-flight token as computed but
unknown) and queues it behind N; it waits for N only then, so the runner goes
from N straight to N+1 while the loop applies N's tokens, hands its outputs off
and plans N+2 (after N's update, so stops and frees are seen). Outputs are the
same as serial stepping, token for token: sampling is keyed by seed, stream and
output position, the runner feeds each step the tokens the previous one sampled,
and a token produced for a request that stopped meanwhile is dropped.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future
from time import perf_counter

from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.engine.core import EngineCore
from asyncllm.messages import StepOutputs
from asyncllm.worker.runner_thread import RunnerFailedError, RunnerThread, TimedOutput


class OverlapStepper:
    """Drives an `EngineCore` built with `async_scheduling` (the core process's
    busy loop and `LLMEngine(multiprocess=False)` both step it)."""

    def __init__(self, core: EngineCore) -> None:
        if not core.config.async_scheduling:
            raise ValueError("OverlapStepper needs an engine core with async_scheduling")
        self.core = core
        self._runner = RunnerThread(core.runner)
        # (plan, its result, schedule start, schedule seconds) of the step in flight
        self._inflight: tuple[SchedulerOutput, Future[TimedOutput], float, float] | None = None
        # (start, end) of each forward on the runner thread, for the benchmarks
        self.exec_spans: deque[tuple[float, float]] = deque(maxlen=20000)

    @property
    def busy(self) -> bool:
        """Whether a step is in flight (its outputs are still to come)."""
        return self._inflight is not None

    @property
    def inflight_plan(self) -> SchedulerOutput | None:
        """The plan of the step in flight, if any."""
        return self._inflight[0] if self._inflight is not None else None

    def step(self) -> StepOutputs | None:
        """Launch the next step if any request is unfinished, then finish the one
        launched before it: its outputs, or None when none was in flight."""
        core = self.core
        launched = None
        if core.scheduler.has_unfinished_requests():
            t0 = perf_counter()
            so = core.schedule()
            launched = (so, self._runner.submit(so), t0, perf_counter() - t0)
        previous, self._inflight = self._inflight, launched
        if previous is None:
            return None
        so, future, t0, schedule_s = previous
        try:
            runner_out, e0, e1 = future.result()
        except BaseException as exc:
            raise RunnerFailedError(f"the model runner thread failed: {exc!r}") from exc
        t2 = perf_counter()
        out = core.update(so, runner_out)
        t3 = perf_counter()
        core.step_timings.append((t0, schedule_s, e1 - e0, t3 - t2, len(out.req_ids), t3))
        self.exec_spans.append((e0, e1))
        return out

    def close(self) -> None:
        self._runner.close()
