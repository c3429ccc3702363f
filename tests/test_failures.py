"""Failure paths fail, never hang: an exception (or a BaseException such as pyo3's
PanicException) in any thread of the engine core ends every waiting request with
EngineDeadError, in a child process and in a thread; an output batch the front end
cannot process fails only its requests; a lost output handler fails /health's
check; the receive queue is bounded and back-pressure reaches the core; sending
never blocks the event loop; timed-out utility calls are forgotten.

Faults are injected from outside the product code: in-thread mode by patching
the core's classes in this process; a core process by a `sitecustomize` module
that the child interpreter imports at start (PYTHONPATH); the front end by a real
frame sent to its output socket; hangs by SIGSTOP."""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap
import time

import pytest
import zmq

from asyncllm import AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from asyncllm.engine.core import EngineCore
from asyncllm.errors import OutputProcessingError
from asyncllm.messages import SchedulerStats, StepOutputs
from fault_injection import POISON, SITECUSTOMIZE, Panic, install_fault
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)

LONG = SamplingParams(max_tokens=1000, ignore_eos=True)
SLOW = 5.0  # null_step_delay_ms: a LONG stream lasts seconds
THREADS = {"input": "input thread", "busy": "busy loop", "output": "output thread"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def engine_for(model_dir, multiprocess=True, **kw) -> AsyncLLM:
    args = EngineArgs(model=str(model_dir), executor="null", **kw)
    return AsyncLLM.from_engine_args(args, multiprocess=multiprocess)


async def stream_until_error(engine, prompt, request_id, started=None):
    """Consume a stream; return the exception that ended it (None if it finished)."""
    try:
        async for _ in engine.generate(prompt, LONG, request_id):
            if started is not None:
                started.set()
    except Exception as exc:
        return exc
    return None


async def poisoned_run(engine):
    """A healthy stream, then a poisoned request: both must end with EngineDeadError."""
    started = asyncio.Event()
    healthy = asyncio.create_task(stream_until_error(engine, [1, 5, 6], "healthy", started))
    await asyncio.wait_for(started.wait(), 30)
    poisoned = await asyncio.wait_for(stream_until_error(engine, [1, POISON, 7], "poison"), 30)
    return await asyncio.wait_for(healthy, 30), poisoned


async def assert_dead(engine, errors, where):
    for err in errors:
        assert isinstance(err, EngineDeadError), err
        assert where in str(err) and "Panic" in str(err), str(err)
    assert engine.errored and not engine.is_running
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    with pytest.raises(EngineDeadError):
        await engine.generate([1, 2], LONG, "late").__anext__()


@pytest.mark.parametrize("thread", list(THREADS))
def test_a_core_thread_failing_in_thread_mode_fails_every_request(model_dir, thread, monkeypatch):
    for cls, name in ((EngineCore, "make_request"), (EngineCore, "add_request")):
        monkeypatch.setattr(cls, name, getattr(cls, name))  # restored after the test
    monkeypatch.setattr(StepOutputs, "encode", StepOutputs.encode)
    install_fault(thread)

    async def main():
        engine = engine_for(model_dir, multiprocess=False, null_step_delay_ms=SLOW)
        try:
            await assert_dead(engine, await poisoned_run(engine), THREADS[thread])
        finally:
            engine.shutdown()
        assert not engine.client._core_thread.is_alive()

    asyncio.run(main())


@pytest.mark.parametrize("thread", list(THREADS))
def test_a_core_thread_failing_in_the_core_process_ends_it_with_status_1(
    model_dir, thread, tmp_path, monkeypatch
):
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    (tmp_path / "sitecustomize.py").write_text(
        textwrap.dedent(SITECUSTOMIZE.format(tests=tests_dir))
    )
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("FAULT_THREAD", thread)

    async def main():
        engine = engine_for(model_dir, null_step_delay_ms=SLOW)
        try:
            await assert_dead(engine, await poisoned_run(engine), THREADS[thread])
        finally:
            engine.shutdown()
        return engine.client.process.exit_code()

    assert asyncio.run(main()) == 1


def test_an_unprocessable_output_batch_fails_its_request_and_the_engine_serves_on(model_dir):
    """A frame from the core naming one request twice makes the detokenizer raise:
    that request fails; the others finish; the core frees its blocks."""

    async def main():
        engine = engine_for(model_dir, null_step_delay_ms=1.0)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        try:
            started = asyncio.Event()
            victim = asyncio.create_task(stream_until_error(engine, [1, 5], "victim", started))
            other = asyncio.create_task(collect_tokens(engine, [1, 6], "other"))
            await asyncio.wait_for(started.wait(), 30)
            (child,) = engine._parents["victim"].children
            frame = StepOutputs(
                [child.core_id, child.core_id], [[5], [6]], SchedulerStats(), time.time()
            ).encode()
            sock.connect(engine.client.process.output_addr)
            sock.send(frame)
            error = await asyncio.wait_for(victim, 30)
            assert isinstance(error, OutputProcessingError), error
            assert "appears more than once" in str(error)
            assert await asyncio.wait_for(other, 60) == LONG.max_tokens
            assert engine.is_running
            await engine.check_health()
            stats = await wait_idle(engine)
            assert stats["num_unfinished"] == 0
            assert stats["num_free_blocks"] == stats["num_blocks"]
        finally:
            sock.close(linger=0)
            ctx.term()
            engine.shutdown()

    asyncio.run(main())


class PanickingDetokenizer:
    """The real detokenizer, whose `step` panics (as pyo3 reports a Rust panic)
    once `armed` is set."""

    def __init__(self, real) -> None:
        self.real = real
        self.armed = False

    def step(self, *args):
        if self.armed:
            raise Panic("detokenizer panic")
        return self.real.step(*args)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_a_panic_while_processing_outputs_kills_the_engine_loudly(model_dir):
    """A Rust panic in the front end's batch processing leaves state that cannot be
    trusted: every request fails with EngineDeadError (not only the batch's)."""

    async def main():
        engine = engine_for(model_dir, null_step_delay_ms=SLOW)
        detok = PanickingDetokenizer(engine.output_processor.detokenizer)
        engine.output_processor.detokenizer = detok
        try:
            started = asyncio.Event()
            waiting = asyncio.create_task(stream_until_error(engine, [1, 5], "w", started))
            await asyncio.wait_for(started.wait(), 30)
            detok.armed = True
            error = await asyncio.wait_for(waiting, 10)
            assert isinstance(error, EngineDeadError) and "panicked" in str(error)
            assert engine.errored
            with pytest.raises(EngineDeadError, match="panicked"):
                await engine.check_health()
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_a_lost_output_handler_fails_health_and_waiting_requests(model_dir):
    async def main():
        engine = engine_for(model_dir, null_step_delay_ms=SLOW)
        try:
            started = asyncio.Event()
            waiting = asyncio.create_task(stream_until_error(engine, [1, 5], "w", started))
            await asyncio.wait_for(started.wait(), 30)
            engine._handler.cancel()  # however the task ends, nothing delivers outputs now
            error = await asyncio.wait_for(waiting, 10)
            assert isinstance(error, EngineDeadError) and "output handler" in str(error)
            with pytest.raises(EngineDeadError, match="output handler"):
                await engine.check_health()
            assert (await asyncio.wait_for(engine.wait_until_dead(), 1)) is engine.dead_error
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_receive_queue_is_bounded_and_a_blocked_loop_stalls_the_core(model_dir):
    """With the event loop blocked, batches stop at the bounded queue and the core
    waits (back-pressure) instead of buffering without limit; nothing is lost."""

    async def main():
        engine = engine_for(model_dir, max_num_seqs=1)  # one request per step: many steps
        try:
            assert engine._batches.maxsize > 0
            await engine.call_utility("get_step_timings", {"clear": True})
            params = SamplingParams(max_tokens=1000, ignore_eos=True)
            tasks = [
                asyncio.create_task(collect_tokens(engine, [1, 5 + i], f"r{i}", params))
                for i in range(12)
            ]
            await asyncio.sleep(0.2)
            # Block the event loop: the core runs ahead by what the queue, the
            # sockets' high-water marks and the kernel's buffers hold (a few
            # thousand steps, fewer than the 12,000 these requests need), then waits.
            time.sleep(5.0)
            assert engine._batches.qsize() <= engine._batches.maxsize
            assert await asyncio.wait_for(asyncio.gather(*tasks), 120) == [1000] * 12
            timings = await engine.call_utility("get_step_timings")
            assert timings["backpressure"], "the core never waited for the front end"
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_sends_never_block_the_event_loop_and_keep_their_order(model_dir):
    """A stopped core fills its input pipe; sends then wait in the client's
    backlog, off the event loop, and go out in order once the core reads again."""

    async def main():
        from asyncllm import _core

        engine = engine_for(model_dir)
        pid = engine.client.process.pid
        try:
            os.kill(pid, signal.SIGSTOP)
            frame = _core.encode_abort(list(range(10**9, 10**9 + 100)))
            for _ in range(20000):  # far past every ZMQ high-water mark
                engine.client.send_raw(frame)
            assert engine.client.num_backlogged > 0
            started = time.monotonic()
            await asyncio.sleep(0.05)  # the loop still runs
            assert time.monotonic() - started < 5
            os.kill(pid, signal.SIGCONT)
            assert await collect_tokens(engine, [1, 5], "after") == LONG.max_tokens
            await engine.check_health()
            assert engine.client.num_backlogged == 0
        finally:
            os.kill(pid, signal.SIGCONT)
            engine.shutdown()

    asyncio.run(main())


def test_timed_out_utility_calls_are_forgotten(model_dir):
    async def main():
        engine = engine_for(model_dir)
        pid = engine.client.process.pid
        try:
            with pytest.raises(RuntimeError, match="unknown utility method"):
                await engine.call_utility("no_such_method")  # fails that call only
            await engine.check_health()
            os.kill(pid, signal.SIGSTOP)  # a hung core
            for _ in range(5):
                with pytest.raises(TimeoutError):
                    await engine.call_utility("get_stats", timeout=0.2)
            with pytest.raises(EngineDeadError, match="did not answer"):
                await engine.check_health(timeout=0.2)
            assert engine.client.num_pending_calls == 0
            os.kill(pid, signal.SIGCONT)
            await engine.check_health()  # the late answers to forgotten calls are dropped
            assert (await engine.get_stats())["num_unfinished"] == 0
            assert engine.client.num_pending_calls == 0
        finally:
            os.kill(pid, signal.SIGCONT)
            engine.shutdown()

    asyncio.run(main())


async def collect_tokens(engine, prompt, request_id, params=LONG) -> int:
    n = 0
    async for out in engine.generate(prompt, params, request_id):
        n = len(out.outputs[0].token_ids)
    return n


async def wait_idle(engine, timeout=5.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats["num_unfinished"] == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)
