"""The runner's grammar rows (structured_output/rows.py): the masks filled ahead right
after a draw, the rows filled afterwards (a request new to sampling, one resumed
with a fresh matcher) and the order of the step's rows all give each request
the mask its own matcher allows, as a fresh matcher fed the same tokens does."""

from __future__ import annotations

import json
import time

import numpy as np

from asyncllm import SamplingParams, StructuredOutputsParams
from asyncllm.core.scheduler_output import NewRequestData
from asyncllm.default_model import default_model_path
from asyncllm.structured_output.grammar_cache import GrammarCache
from asyncllm.structured_output.rows import GrammarRows

EOS = 2
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}}


def new_request(req_id: int, grammar, outputs: list[int] = ()) -> NewRequestData:
    prompt = [1, 5, 6]
    return NewRequestData(
        req_id=req_id,
        token_ids=prompt + list(outputs),
        num_prompt_tokens=len(prompt),
        sampling_params=SamplingParams(),
        block_ids=[],
        num_computed_tokens=0,
        stop_token_ids=frozenset({EOS}),
        grammar=grammar,
    )


def expected_mask(cache: GrammarCache, grammar, tokens: list[int]) -> np.ndarray:
    matcher = grammar.matcher()
    if tokens:
        matcher.consume(tokens)
    out = np.zeros((1, cache.compiler.words), dtype=np.int32)
    cache.compiler.fill_bitmasks([matcher], out, [0])
    return out[0]


def allowed(mask: np.ndarray, which: int) -> int:
    """The `which`-th allowed token other than EOS (the last if fewer), or EOS."""
    bits = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little"))
    others = bits[bits != EOS]
    return int(others[min(which, len(others) - 1)]) if len(others) else EOS


def test_masks_filled_ahead_and_after_are_each_rows_own():
    cache = GrammarCache(default_model_path() / "tokenizer.json", [EOS], 8192)
    grammar = cache.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    rows = GrammarRows(cache, max_num_seqs=4)
    outputs: dict[int, list[int]] = {1: [], 2: []}
    rows.add(new_request(1, grammar))
    rows.add(new_request(2, grammar))
    for step in range(6):
        req_ids = [2, 7, 1] if step % 2 else [1, 2, 7]  # 7: not constrained
        masks = rows.bitmask_async(req_ids)
        assert masks is not None
        idx, bitmask = masks.result()
        constrained = [req_ids[i] for i in idx.tolist()]
        assert constrained == [r for r in req_ids if r != 7]
        for rid, mask in zip(constrained, bitmask, strict=True):
            assert np.array_equal(mask, expected_mask(cache, grammar, outputs[rid])), (step, rid)
        sampled = [0] * len(req_ids)
        for i, mask in zip(idx.tolist(), bitmask, strict=True):
            rid = req_ids[i]
            sampled[i] = allowed(mask, 0 if rid == 1 else 1)  # the two diverge
            outputs[rid].append(sampled[i])
        rows.advance(req_ids, sampled, idx)
        if step == 2:  # a new request joins; request 1 is preempted and resumed
            rows.add(new_request(3, grammar))
            outputs[3] = []
            rows.remove(1)
            rows.add(new_request(1, grammar, outputs[1]))
            idx3 = rows.bitmask_async([3, 1, 2])
            assert idx3 is not None
            _, bitmask = idx3.result()
            for rid, mask in zip([3, 1, 2], bitmask, strict=True):
                assert np.array_equal(mask, expected_mask(cache, grammar, outputs[rid])), rid
            rows.remove(3)  # finished before it sampled
    assert rows.bitmask_async([7, 8]) is None


def test_jobs_run_in_order_off_the_callers_thread_and_equal_the_calls_they_replace():
    """`advance_fill` queues the advance and the fill on the extension's grammar
    thread and returns at once: its masks equal `advance` then `fill_bitmasks`,
    a fill queued after an advance sees the advanced matcher, and the job's
    errors reach `wait()`."""
    cache = GrammarCache(default_model_path() / "tokenizer.json", [EOS], 8192)
    compiler = cache.compiler
    grammar = cache.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    ours = [grammar.matcher() for _ in range(3)]
    theirs = [grammar.matcher() for _ in range(3)]
    out = np.zeros((6, compiler.words), dtype=np.int32)
    want = np.zeros((3, compiler.words), dtype=np.int32)
    compiler.fill_bitmasks(theirs, want, [0, 1, 2])
    first = compiler.advance_fill([], [], ours, out, [0, 1, 2])
    assert first.wait() == []
    assert np.array_equal(out[:3], want)
    for step in range(5):
        tokens = [allowed(want[i], i + step) for i in range(3)]
        compiler.advance(theirs, tokens)
        compiler.fill_bitmasks(theirs, want, [0, 1, 2])
        # the advance-and-fill, then a second fill of the same matchers queued behind it
        queued = time.perf_counter()
        job = compiler.advance_fill(ours, tokens, ours, out, [2, 0, 4])
        again = compiler.advance_fill([], [], ours, out, [1, 3, 5])
        assert again.wait() == [] and job.wait() == []
        waited = time.perf_counter() - queued
        # the job ran, on the grammar thread, between its queuing and the wait's end
        assert 0.0 < job.run_seconds <= waited
        assert np.array_equal(out[[2, 0, 4]], want), step
        assert np.array_equal(out[[1, 3, 5]], want), step
    # a matcher listed twice cannot be locked twice: the job fails, loudly
    twice = compiler.advance_fill([], [], [ours[0], ours[0]], out, [0, 1])
    try:
        twice.wait()
        raise AssertionError("a matcher listed twice must fail the job")
    except RuntimeError as e:
        assert "listed twice" in str(e)
    # bad rows fail at once, naming the problem, and queue nothing
    for rows, message in (([0, 0, 1], "listed twice"), ([0, 1, 6], "out of range")):
        try:
            compiler.advance_fill([], [], ours, out, rows)
            raise AssertionError("bad rows must raise")
        except ValueError as e:
            assert message in str(e)
    try:
        compiler.advance_fill(ours, [1], ours, out, [0, 1, 2])
        raise AssertionError("one token per matcher to advance")
    except ValueError as e:
        assert "3 matchers to advance but 1 tokens" in str(e)


def test_a_job_dropped_unwaited_keeps_its_array_until_it_ends():
    """The job writes into the caller's array from its own thread: dropping both
    before it ends must neither crash nor write into freed memory (the job holds
    the array; dropping it waits)."""
    cache = GrammarCache(default_model_path() / "tokenizer.json", [EOS], 8192)
    grammar = cache.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    for _ in range(50):
        ms = [grammar.matcher() for _ in range(16)]
        out = np.zeros((16, cache.compiler.words), dtype=np.int32)
        job = cache.compiler.advance_fill([], [], ms, out, list(range(16)))
        del out, job
    # the grammar thread still serves after all that
    out = np.zeros((1, cache.compiler.words), dtype=np.int32)
    assert cache.compiler.advance_fill([], [], [grammar.matcher()], out, [0]).wait() == []
    assert out.any()


def test_a_forked_process_gets_a_grammar_thread_of_its_own():
    """A fork copies the compiler but not its grammar thread: a job queued in the
    child must still run (on a thread the child starts), not wait forever."""
    import os
    import time

    cache = GrammarCache(default_model_path() / "tokenizer.json", [EOS], 8192)
    grammar = cache.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    out = np.zeros((1, cache.compiler.words), dtype=np.int32)
    assert cache.compiler.advance_fill([], [], [grammar.matcher()], out, [0]).wait() == []
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its job ran
        code = 1
        try:
            out[:] = 0
            job = cache.compiler.advance_fill([], [], [grammar.matcher()], out, [0])
            code = 0 if job.wait() == [] and out.any() else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise AssertionError("the forked child's job never ran")
