"""Overlap ("async") scheduling at its boundaries: a request that stops at step N
while step N+1 is already planned, max_tokens, aborts, preemption, n > 1,
logprobs, and token-for-token equality with serial stepping; a failure on the
runner thread fails the engine instead of hanging it.

The core-level tests drive a real `EngineCore` on the null executor (its tokens
are a known function of request and position, so a stop token can be placed at
an exact step); the end-to-end ones run the shipped model through `LLM`, in
this process and in a core process.
"""

from __future__ import annotations

import asyncio

import pytest

from asyncllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, InvalidRequestError, SamplingParams
from asyncllm.engine.core import EngineCore, build_engine_core
from asyncllm.engine.overlap import OverlapStepper
from asyncllm.messages import EngineCoreRequest, StepOutputs
from asyncllm.worker.null_runner import NullModelRunner, null_token
from asyncllm.worker.runner_thread import RunnerFailedError

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(100, 120))  # 20 tokens
POISON = [999, 999, 999]  # a prompt the failing runner below fails on
VOCAB = 8192  # asyncllm-tiny's


def null_core(overlap: bool, **kw) -> tuple[EngineCore, OverlapStepper | None]:
    args = EngineArgs(executor="null", async_scheduling=overlap, max_model_len=256, **kw)
    core = build_engine_core(args)
    return core, OverlapStepper(core) if overlap else None


def next_outputs(core: EngineCore, stepper: OverlapStepper | None) -> StepOutputs | None:
    return stepper.step() if stepper else core.step()


def drive(core, stepper, on_output=None):
    """Step until every request ended (and nothing is in flight); per request its
    tokens and finish reason. Fails on any output after a request's final one."""
    tokens: dict[int, list[int]] = {}
    reasons: dict[int, str] = {}
    while core.has_unfinished_requests() or (stepper is not None and stepper.busy):
        out = next_outputs(core, stepper)
        if out is None:
            continue
        for i, rid in enumerate(out.req_ids):
            assert rid not in reasons, f"request {rid} got a token after it finished"
            tokens.setdefault(rid, []).append(out.new_token_ids[i])
            reason = out.finish_reasons[i] if out.finish_reasons else None
            if reason is not None:
                reasons[rid] = reason
        if on_output is not None:
            on_output(out)
    return tokens, reasons


def assert_all_free(core: EngineCore) -> None:
    assert core.kv_cache.num_free_blocks == core.num_kv_blocks
    assert not core.kv_cache.req_to_blocks
    assert not core.scheduler.requests and not core.scheduler.running


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_stop_token_at_step_n_drops_the_planned_extra_token(overlap):
    core, stepper = null_core(overlap)
    # request 1 stops on the token it samples as its 5th output; 2 runs on
    stop_at = null_token(1, len(PROMPT) + 4, VOCAB)
    core.add_request(
        EngineCoreRequest(1, PROMPT, SamplingParams(max_tokens=50, stop_token_ids=[stop_at]))
    )
    core.add_request(EngineCoreRequest(2, PROMPT, SamplingParams(max_tokens=12)))
    planned_after_stop: list[bool] = []

    def on_output(out: StepOutputs) -> None:
        if 1 in out.req_ids and out.finish_reasons and out.finish_reasons[out.req_ids.index(1)]:
            plan = stepper.inflight_plan if stepper else None
            planned_after_stop.append(plan is not None and 1 in plan.num_scheduled_tokens)

    tokens, reasons = drive(core, stepper, on_output)
    assert tokens[1] == [null_token(1, len(PROMPT) + i, VOCAB) for i in range(5)]
    assert tokens[1][-1] == stop_at
    assert reasons == {1: "stop", 2: "length"}
    assert len(tokens[2]) == 12
    # with overlap, step N+1 had been planned for request 1 before it stopped at N
    assert planned_after_stop == [overlap]
    assert_all_free(core)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_max_tokens_is_exact_and_never_planned_past(overlap):
    core, stepper = null_core(overlap)
    for rid, k in enumerate((1, 2, 3, 7), start=1):
        core.add_request(EngineCoreRequest(rid, PROMPT, SamplingParams(max_tokens=k)))
    planned: dict[int, int] = {}

    def on_output(out: StepOutputs) -> None:
        plan = stepper.inflight_plan if stepper else None
        for rid in plan.num_scheduled_tokens if plan else ():
            planned[rid] = planned.get(rid, 0) + 1

    tokens, reasons = drive(core, stepper, on_output)
    assert {rid: len(t) for rid, t in tokens.items()} == {1: 1, 2: 2, 3: 3, 4: 7}
    assert set(reasons.values()) == {"length"}
    # the scheduler knows the length in advance: no step is planned past it
    for rid, k in ((2, 2), (3, 3), (4, 7)):
        assert planned.get(rid, 0) <= k
    assert_all_free(core)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_abort_mid_stream_with_a_step_in_flight(overlap):
    core, stepper = null_core(overlap)
    for rid in (1, 2, 3):
        core.add_request(EngineCoreRequest(rid, PROMPT, SamplingParams(max_tokens=40)))
    aborted: list[int] = []

    def on_output(out: StepOutputs) -> None:
        if not aborted and 2 in out.req_ids:
            final = core.abort_requests([2])  # between steps: one is in flight
            assert final.req_ids == [2] and final.finish_reasons == ["abort"]
            aborted.append(2)

    tokens, reasons = drive(core, stepper, on_output)
    assert len(tokens[2]) == 1  # nothing after the abort
    assert len(tokens[1]) == len(tokens[3]) == 40
    assert_all_free(core)


def test_mixed_batch_is_identical_on_the_null_executor_with_preemption():
    """Chunked prompts, stops, length limits, preemption (a small KV pool):
    the same tokens and reasons per request in both modes."""
    results = []
    for overlap in (False, True):
        core, stepper = null_core(
            overlap, num_kv_blocks=24, block_size=4, max_num_batched_tokens=32, max_num_seqs=8
        )
        for rid in range(1, 25):
            prompt = [100 + (rid * 13 + j) % 500 for j in range(5 + rid % 11)]
            stop = [null_token(rid, len(prompt) + rid % 9, VOCAB)] if rid % 3 == 0 else None
            params = SamplingParams(
                max_tokens=4 + rid % 13, stop_token_ids=stop, min_tokens=rid % 2
            )
            core.add_request(EngineCoreRequest(rid, prompt, params))
        results.append(drive(core, stepper))
        assert core.scheduler.num_preemptions > 0
        assert_all_free(core)
    assert results[0] == results[1]


# --- the runner thread fails loudly -------------------------------------------------------


class Panic(BaseException):
    """Like pyo3's PanicException: a BaseException, not an Exception."""


@pytest.fixture
def failing_runner(monkeypatch):
    """The null runner raises on the step that admits a POISON prompt."""
    original = NullModelRunner.execute_model

    def execute_model(self, so):
        if any(new.token_ids == POISON for new in so.new_reqs):
            raise Panic("injected runner fault")
        return original(self, so)

    monkeypatch.setattr(NullModelRunner, "execute_model", execute_model)


def test_runner_thread_failure_raises_in_the_stepping_thread(failing_runner):
    core, stepper = null_core(True)
    core.add_request(EngineCoreRequest(13, POISON, SamplingParams(max_tokens=4)))
    assert stepper is not None
    with pytest.raises(RunnerFailedError, match="injected runner fault"):
        for _ in range(3):
            stepper.step()
    stepper.close()


def test_runner_thread_failure_kills_the_engine_core(failing_runner):
    """In-thread core (this process, so the patch applies): every stream fails."""

    async def go() -> None:
        args = EngineArgs(executor="null", async_scheduling=True, null_step_delay_ms=2.0)
        engine = AsyncLLM.from_engine_args(args, multiprocess=False)
        try:
            ok = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=500), "a")
            first = await ok.__anext__()  # "a" is running
            assert first.outputs[0].token_ids
            bad = engine.generate({"prompt_token_ids": POISON}, SamplingParams(max_tokens=5), "b")

            async def fails(stream) -> None:
                with pytest.raises(EngineDeadError, match="runner thread failed"):
                    async for _ in stream:
                        pass

            await asyncio.gather(fails(ok), fails(bad))
        finally:
            engine.shutdown()

    asyncio.run(asyncio.wait_for(go(), 60))


# --- end to end on the shipped model ----------------------------------------------------


def mixed_requests() -> tuple[list, list[SamplingParams]]:
    prompts = [f"def function_{i}(value):\n    return" for i in range(10)] + [
        "The quick brown fox " * 6
    ] * 3
    params = []
    for i in range(len(prompts)):
        params.append(
            SamplingParams(
                max_tokens=3 + 5 * (i % 6),
                temperature=0.0 if i % 2 else 0.9,
                seed=1000 + i,
                top_p=0.9 if i % 4 == 1 else 1.0,
                logprobs=2 if i % 3 == 0 else None,
                prompt_logprobs=1 if i == 4 else None,
                min_tokens=2 if i % 5 == 0 else 0,
                presence_penalty=0.4 if i % 5 == 2 else 0.0,
                repetition_penalty=1.2 if i % 7 == 3 else 1.0,
                stop=["\n\n"] if i % 4 == 2 else None,
                n=2 if i == 6 else 1,
            )
        )
    return prompts, params


def summary(outputs) -> tuple[list, list[float]]:
    """Everything a user sees per completion, exactly, and apart the logprob
    values (batch composition alone moves them in the last bits, in either mode)."""
    rows: list = []
    values: list[float] = []
    for out in outputs:
        for c in out.outputs:
            lps = [sorted((t, lp.rank) for t, lp in step.items()) for step in c.logprobs or []]
            values += [lp.logprob for step in c.logprobs or [] for lp in step.values()]
            rows.append((out.request_id, c.index, c.token_ids, c.text, c.finish_reason, lps))
        for step in out.prompt_logprobs or []:
            rows.append(None if step is None else sorted(step))
            values += [lp.logprob for lp in (step or {}).values()]
    return rows, values


@pytest.mark.parametrize("multiprocess", [False, True], ids=["in-process", "core-process"])
def test_mixed_batch_identical_token_for_token(multiprocess):
    prompts, params = mixed_requests()
    results = []
    for overlap in (False, True):
        # a small pool and token budget: chunked prompts and preemption
        with LLM(
            multiprocess=multiprocess,
            dtype="float32",
            async_scheduling=overlap,
            max_num_seqs=6,
            max_num_batched_tokens=32,
            num_kv_blocks=12,
            block_size=8,
            max_model_len=80,
        ) as llm:
            results.append(summary(llm.generate(prompts, params, use_tqdm=False)))
            if not multiprocess:
                core = llm.engine.core
                assert core is not None and core.scheduler.num_preemptions > 0
                assert core.kv_cache.num_free_blocks == core.num_kv_blocks
    (serial, serial_values), (overlap, overlap_values) = results
    assert serial == overlap
    assert overlap_values == pytest.approx(serial_values, abs=1e-4)


# --- the overlap scheduler run ahead, on its own ---------------------------------------------


def test_a_request_preempted_with_its_stop_token_in_flight_ends_from_the_waiting_queue():
    from asyncllm.core.async_scheduler import AsyncScheduler
    from asyncllm.core.kv_cache_manager import KVCacheManager
    from asyncllm.core.request import Request, RequestStatus

    sched = AsyncScheduler(
        KVCacheManager(3, 4, True), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
    )

    def request(rid: int, prompt: list[int]) -> Request:
        params = SamplingParams(max_tokens=8)
        return Request(
            rid, prompt, params, eos_token_ids=[0], max_model_len=64, block_size=4, hash_blocks=True
        )

    a, b = request(1, [5, 6, 7, 8]), request(2, [9, 10, 11, 12])
    sched.add_request(a)
    sched.add_request(b)
    first = sched.schedule()  # both prompts: one block each, one token each in flight
    assert first.num_scheduled_tokens == {1: 4, 2: 4}
    second = sched.schedule()  # step 1 still running: each needs a new block, one is left
    assert second.num_scheduled_tokens == {1: 1} and second.preempted_req_ids == {2}
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 1
    # step 1's tokens arrive: b's is EOS, so b ends although it waits to be resumed
    stepped, finished = sched.update_from_output(first, {1: 3, 2: 0})
    assert finished and [r.request_id for r in stepped] == [1, 2]
    assert b.finish_reason == "stop" and b.all_token_ids[-1] == 0
    assert b not in sched.waiting and 2 not in sched.requests
    sched.update_from_output(second, {1: 4})
    while sched.has_unfinished_requests():  # a runs to its length, step by step
        so = sched.schedule()
        sched.update_from_output(so, dict.fromkeys(so.num_scheduled_tokens, 4))
    assert a.num_output_tokens == 8 and a.finish_reason == "length"
    assert sched.kv_cache.num_free_blocks == 3


def test_an_id_that_may_be_in_flight_is_not_taken_again():
    core, stepper = null_core(True)
    core.add_request(EngineCoreRequest(1, PROMPT, SamplingParams(max_tokens=50)))
    assert stepper is not None
    while stepper.step() is None:  # until step 0 is out and step 1 in flight
        pass
    core.abort_requests([1])  # request 1 is in the step in flight
    with pytest.raises(InvalidRequestError, match="already running"):
        core.add_request(EngineCoreRequest(1, PROMPT, SamplingParams(max_tokens=5)))
    while stepper.busy or core.has_unfinished_requests():
        stepper.step()
    core.add_request(EngineCoreRequest(1, PROMPT, SamplingParams(max_tokens=5)))  # free now
    tokens, reasons = drive(core, stepper)
    assert tokens[1] == [null_token(1, len(PROMPT) + i, VOCAB) for i in range(5)]
    assert_all_free(core)


# --- the timeline -------------------------------------------------------------------------


def test_an_overlap_trace_has_every_steps_phases_on_two_threads(tmp_path):
    """Schedule and update on the core's stepping thread, execute (with the
    runner's phases inside) on the runner thread; a step's phases in order, and
    step N+1 planned before step N's update."""
    import json

    trace = tmp_path / "trace"
    with LLM(
        multiprocess=True, dtype="float32", async_scheduling=True, trace_dir=str(trace)
    ) as llm:
        params = SamplingParams(max_tokens=6, ignore_eos=True)
        llm.generate([[1, 5, 7], [2, 9, 4, 4]], params, use_tqdm=False)
    (core_file,) = trace.glob("core-*.json")
    events = [e for e in json.loads(core_file.read_text())["traceEvents"] if e["ph"] == "X"]
    by_step: dict[int, dict[str, dict]] = {}
    for e in events:
        if e["name"] in ("schedule", "execute", "update") and "step" in (e.get("args") or {}):
            by_step.setdefault(e["args"]["step"], {})[e["name"]] = e
    complete = [p for p in by_step.values() if len(p) == 3]
    assert len(complete) >= 6  # one step per generated token at least
    eps = 1e-3
    for p in complete:
        s, x, u = p["schedule"], p["execute"], p["update"]
        assert s["tid"] == u["tid"] != x["tid"]
        assert s["ts"] + s["dur"] <= x["ts"] + eps and x["ts"] + x["dur"] <= u["ts"] + eps
        if x["args"]["tokens"]:  # (a plan may be empty: its requests' last tokens in flight)
            forward = [e for e in events if e["name"] == "forward" and e["tid"] == x["tid"]]
            assert any(x["ts"] - eps <= f["ts"] <= x["ts"] + x["dur"] + eps for f in forward)
    overlapped = [
        n
        for n in by_step
        if n + 1 in by_step
        and "update" in by_step[n]
        and by_step[n + 1]["schedule"]["ts"] < by_step[n]["update"]["ts"]
    ]
    assert overlapped  # the next step was planned while this one ran


def test_a_profile_window_closes_itself_in_overlap_mode(tmp_path):
    """A forgotten /stop_profile: the window counts overlapped steps too and stops
    at its limit, writing its trace."""
    core, stepper = null_core(True, profile_dir=str(tmp_path))
    assert core.profiler is not None and stepper is not None
    core.profiler.max_steps = 3
    core.start_profile()
    core.add_request(EngineCoreRequest(0, PROMPT, SamplingParams(max_tokens=8, ignore_eos=True)))
    drive(core, stepper)
    stepper.close()
    assert not core.profiler.active
    assert list(tmp_path.glob("*.json")), "the profile's trace was not written"
