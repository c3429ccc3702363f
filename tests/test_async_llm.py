"""AsyncLLM against a real engine-core process over real sockets: streaming,
abort, cancellation, stop strings, n > 1, health, death and shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from asyncllm import (
    LLM,
    AsyncLLM,
    EngineArgs,
    EngineDeadError,
    InvalidRequestError,
    RequestOutputKind,
    SamplingParams,
)
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def run(coro):
    return asyncio.run(coro)


def engine_for(model_dir, **kw) -> AsyncLLM:
    return AsyncLLM.from_engine_args(EngineArgs(model=str(model_dir), dtype="float32", **kw))


async def collect(engine, prompt, params, request_id):
    outs = []
    async for out in engine.generate(prompt, params, request_id):
        outs.append(out)
    return outs


async def wait_idle(engine, timeout=5.0):
    """The core's view once every request is gone: stats polled until it settles."""
    deadline = time.monotonic() + timeout
    while True:
        stats = await engine.get_stats()
        if stats["num_unfinished"] == 0 or time.monotonic() > deadline:
            return stats


def assert_core_idle(stats):
    assert stats["num_running"] == 0
    assert stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"]


@pytest.mark.usefixtures("scheduling_mode")
def test_256_streams_match_an_in_process_run(model_dir):
    prompts = [[1] + [(7 * i + j) % 900 + 10 for j in range(3 + i % 13)] for i in range(256)]
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=4 + i % 5,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA if i % 2 else RequestOutputKind.CUMULATIVE,
        )
        for i in range(256)
    ]
    reference = LLM(str(model_dir), multiprocess=False, dtype="float32").generate(
        prompts, params, use_tqdm=False
    )

    async def main():
        engine = engine_for(model_dir)
        try:
            results = await asyncio.gather(
                *(
                    collect(engine, p, sp, f"r{i}")
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=False))
                )
            )
            stats = await wait_idle(engine)
        finally:
            engine.shutdown()
        return results, stats

    results, stats = run(main())
    for i, (outs, ref) in enumerate(zip(results, reference, strict=True)):
        expected = ref.outputs[0]
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        if params[i].output_kind == RequestOutputKind.DELTA:
            tokens = [t for o in outs for t in o.outputs[0].token_ids]
            text = "".join(o.outputs[0].text for o in outs)
        else:
            tokens, text = outs[-1].outputs[0].token_ids, outs[-1].outputs[0].text
        assert tokens == expected.token_ids, f"stream {i}"
        assert text == expected.text, f"stream {i}"
    assert_core_idle(stats)


@pytest.mark.usefixtures("scheduling_mode")
def test_abort_cancel_close_and_n_children_free_everything(model_dir):
    long = SamplingParams(temperature=0.0, max_tokens=900, ignore_eos=True)

    async def main():
        engine = engine_for(model_dir, max_model_len=1024)
        try:
            # 1. explicit abort
            gen = engine.generate([1, 5, 6, 7], long, "aborted")
            first = await gen.__anext__()
            assert not first.finished
            await engine.abort("aborted")
            rest = [o async for o in gen]
            assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"

            # 2. the consumer task is cancelled
            async def consume():
                async for _ in engine.generate([1, 8, 9], long, "cancelled"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            # 3. the generator is closed early
            gen = engine.generate([1, 10, 11], long, "closed")
            await gen.__anext__()
            await gen.aclose()
            # 4. n > 1, aborted mid-stream
            gen = engine.generate(
                [1, 12, 13], SamplingParams(n=3, max_tokens=900, ignore_eos=True, seed=1), "fanout"
            )
            await gen.__anext__()
            await engine.abort("fanout")
            final = [o async for o in gen][-1]
            assert final.finished and [c.finish_reason for c in final.outputs] == ["abort"] * 3
            return await wait_idle(engine)
        finally:
            engine.shutdown()

    assert_core_idle(run(main()))


@pytest.mark.usefixtures("scheduling_mode")
def test_stop_string_ends_the_stream_and_the_core_request(model_dir):
    async def main():
        engine = engine_for(model_dir)
        try:
            greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            full = (await collect(engine, [1, 20, 21, 22], greedy, "full"))[-1].outputs[0]
            stop = full.text[len(full.text) // 2 :][:3]
            params = SamplingParams(
                temperature=0.0,
                max_tokens=40,
                ignore_eos=True,
                stop=[stop],
                output_kind=RequestOutputKind.DELTA,
            )
            outs = await collect(engine, [1, 20, 21, 22], params, "stopped")
            return full, stop, outs, await wait_idle(engine)
        finally:
            engine.shutdown()

    full, stop, outs, stats = run(main())
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert "".join(o.outputs[0].text for o in outs) == full.text[: full.text.index(stop)]
    assert_core_idle(stats)


def test_duplicate_request_id_rejected(model_dir):
    async def main():
        engine = engine_for(model_dir)
        try:
            gen = engine.generate([1, 5], SamplingParams(max_tokens=500, ignore_eos=True), "dup")
            await gen.__anext__()
            with pytest.raises(InvalidRequestError, match="already running"):
                await engine.generate([1, 6], None, "dup").__anext__()
            await gen.aclose()
        finally:
            engine.shutdown()

    run(main())


def test_invalid_requests_and_malformed_frames_fail_alone(model_dir):
    from asyncllm import _core

    async def main():
        engine = engine_for(model_dir, max_model_len=64)
        try:
            with pytest.raises(InvalidRequestError, match="max_model_len=64"):
                await engine.generate(list(range(1, 100)), None, "long").__anext__()
            # frames the front end would never send: garbage, truncated, unknown type
            good = _core.encode_abort([1, 2, 3])
            for frame in (b"", b"\x00garbage", good[:-1], b"\x7f" + good[1:]):
                engine.client.send_raw(frame)
            # a request the core must reject itself (token outside the vocabulary)
            engine.client.add_requests([_core.AddRequest(10**9, [10**7], max_tokens=4)])
            outs = await collect(
                engine, [1, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True), "ok"
            )
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
            await engine.check_health()
        finally:
            engine.shutdown()

    run(main())


def test_kill_9_fails_every_stream_with_the_cause(model_dir):
    """Every running stream ends in EngineDeadError caused by the kill: after it,
    before its tokens ran out, naming the signal's exit code."""

    async def main():
        engine = engine_for(model_dir, max_model_len=1024)
        long = SamplingParams(max_tokens=1000, ignore_eos=True)
        errors = []
        running = [asyncio.Event() for _ in range(8)]

        async def consume(i):
            count = 0
            try:
                async for out in engine.generate([1, 5 + i], long, f"s{i}"):
                    count = len(out.outputs[0].token_ids)
                    running[i].set()
            except EngineDeadError as exc:
                errors.append((time.monotonic(), count, exc))

        tasks = [asyncio.create_task(consume(i)) for i in range(8)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 60)
        killed_at = time.monotonic()
        os.kill(engine.client.process.pid, signal.SIGKILL)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)  # a hang guard, not a speed bound
        assert len(errors) == 8
        for failed_at, count, exc in errors:
            assert failed_at >= killed_at and count < 1000, (failed_at - killed_at, count)
            assert "code -9" in str(exc), exc
        assert engine.errored and not engine.is_running
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        with pytest.raises(EngineDeadError):
            await engine.generate([1, 2], None, "late").__anext__()
        engine.shutdown()
        engine.shutdown()  # idempotent

    run(main())


def test_hung_core_fails_health_check_within_timeout(model_dir):
    async def main():
        engine = engine_for(model_dir)
        pid = engine.client.process.pid
        try:
            await engine.check_health()
            os.kill(pid, signal.SIGSTOP)
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="did not answer"):
                await asyncio.wait_for(engine.check_health(timeout=1.0), 60)
            # the check's own timeout ended it: it waited that long, not less
            assert time.monotonic() - start >= 1.0
        finally:
            os.kill(pid, signal.SIGCONT)
            engine.shutdown()

    run(main())
