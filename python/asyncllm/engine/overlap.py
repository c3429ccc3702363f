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

from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.engine.core import EngineCore
from asyncllm.messages import StepOutputs
from asyncllm.worker.runner_thread import RunnerFailedError, RunnerThread, TimedOutput


class OverlapStepper:
    """Drives an `EngineCore` built with `async_scheduling` (the core process's
    busy loop and `LLMEngine(multiprocess=False)` both step it). With a trace,
    schedule and update are spans of the stepping thread and execute one of the
    runner thread (the runner's own phases nest in it); steps overlap in time, so
    there is no enclosing step span."""

    def __init__(self, core: EngineCore) -> None:
        if not core.config.async_scheduling:
            raise ValueError("OverlapStepper needs an engine core with async_scheduling")
        self.core = core
        self._runner = RunnerThread(core.runner)
        # (plan, its result, schedule start and end (ns), its number) of the step
        # in flight; the number links a step's spans across the two threads
        self._inflight: tuple[SchedulerOutput, Future[TimedOutput], int, int, int] | None = None
        self._num_steps = 0
        # (forward start, forward end, update end) per step, on the trace clock,
        # while the core keeps step timings (the benchmarks)
        self.spans: deque[tuple[int, int, int]] = deque(maxlen=20000)

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
        rec = core.recorder
        launched = None
        if core.scheduler.has_unfinished_requests():
            self._num_steps += 1
            t0 = rec.begin("schedule") if rec is not None else 0
            so = core.schedule()
            t1 = 0
            if rec is not None:
                args = {"step": self._num_steps, "batch": len(so.num_scheduled_tokens)}
                t1 = rec.end("schedule", t0, args)
            launched = (so, self._runner.submit(so), t0, t1, self._num_steps)
        previous, self._inflight = self._inflight, launched
        if previous is None:
            return None
        so, future, t0, t1, step_no = previous
        try:
            runner_out, e0, e1, runner_tid = future.result()
            runner_out = runner_out.resolved()
        except BaseException as exc:
            raise RunnerFailedError(f"the model runner thread failed: {exc!r}") from exc
        if rec is None:
            return core.update(so, runner_out)
        t2 = rec.begin("update")
        out = core.update(so, runner_out)
        t3 = rec.end("update", t2, {"step": step_no, "outputs": len(out.req_ids)})
        rec.count_profiled_step()
        if rec.tracer is not None:  # the forward, on the runner thread's track
            args = {
                "step": step_no,
                "batch": len(so.num_scheduled_tokens),
                "tokens": so.total_num_scheduled_tokens,
            }
            rec.tracer.events.append(("execute", e0, e1 - e0, runner_tid, args))
        timings = core.step_timings
        if timings is not None:
            timings.append(
                (t0 / 1e9, (t1 - t0) / 1e9, (e1 - e0) / 1e9, (t3 - t2) / 1e9, len(out.req_ids))
            )
            self.spans.append((e0, e1, t3))
        return out

    def close(self) -> None:
        self._runner.close()
