"""The scheduler and KV-cache manager on their own: no model, token ids only."""

from __future__ import annotations

import pytest

from asyncllm.core.async_scheduler import AsyncScheduler
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.sampling_params import SamplingParams

BLOCK = 4
# Every test runs with both schedulers, stepped one step at a time (the overlap
# scheduler then behaves as the serial one; tests/test_overlap.py runs it ahead).
SCHEDULERS = {"serial": Scheduler, "overlap": AsyncScheduler}
_scheduler_cls: list[type[Scheduler]] = [Scheduler]


@pytest.fixture(autouse=True, params=list(SCHEDULERS))
def scheduler_kind(request):
    _scheduler_cls[0] = SCHEDULERS[request.param]
    yield request.param
    _scheduler_cls[0] = Scheduler


def make_scheduler(num_blocks=64, max_seqs=8, budget=64, max_len=256, caching=True):
    kv = KVCacheManager(num_blocks, BLOCK, caching)
    return _scheduler_cls[0](
        kv, max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=max_len
    )


def samples(sched, rid, num_scheduled):
    """Whether the step just scheduled samples a token for `rid`."""
    request = sched.requests[rid]
    if isinstance(sched, AsyncScheduler):  # progress is counted when scheduled
        return request.num_output_placeholders > 0
    return request.num_computed_tokens + num_scheduled == request.num_tokens


def make_request(rid, prompt, max_tokens=4, caching=True, **params):
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=[0],
        max_model_len=256,
        block_size=BLOCK,
        hash_blocks=caching,
    )


def run_step(sched, token=7):
    so = sched.schedule()
    sampled = {rid: token for rid, n in so.num_scheduled_tokens.items() if samples(sched, rid, n)}
    return so, sched.update_from_output(so, sampled)[0]


def assert_pool_full(sched):
    pool = sched.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not sched.kv_cache.req_to_blocks


def test_decodes_and_prompts_share_one_budget():
    sched = make_scheduler(budget=16)
    sched.add_request(make_request("a", range(1, 11)))  # 10 tokens
    so, _ = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 10}
    sched.add_request(make_request("b", range(101, 121)))  # 20 tokens: must be chunked
    so, stepped = run_step(sched)
    # a decodes (1 token) and b gets the remaining 15 of the budget
    assert so.num_scheduled_tokens == {"a": 1, "b": 15}
    assert [r.request_id for r in stepped] == ["a"]  # b is mid-prompt: nothing sampled
    so, stepped = run_step(sched)
    assert so.num_scheduled_tokens == {"a": 1, "b": 5}
    assert {r.request_id for r in stepped} == {"a", "b"}


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [5] * 4))
    so, _ = run_step(sched)
    assert set(so.num_scheduled_tokens) == {"0", "1"}
    assert len(sched.waiting) == 1


def test_finish_by_length_and_stop_token_frees_blocks():
    sched = make_scheduler()
    sched.add_request(make_request("len", [3] * 6, max_tokens=3))
    sched.add_request(make_request("eos", [4] * 6, max_tokens=10))
    run_step(sched, token=9)
    so = sched.schedule()
    stepped, _ = sched.update_from_output(so, {"len": 9, "eos": 0})
    by_id = {r.request_id: r for r in stepped}
    assert by_id["eos"].status == RequestStatus.FINISHED_STOPPED
    assert by_id["eos"].stop_reason == 0
    run_step(sched, token=9)
    assert not sched.has_unfinished_requests()
    assert_pool_full(sched)


def test_min_tokens_defers_stop_tokens():
    sched = make_scheduler()
    req = make_request("r", [3] * 5, max_tokens=10, min_tokens=2)
    sched.add_request(req)
    for _ in range(2):
        run_step(sched, token=0)
        assert not req.is_finished
    run_step(sched, token=0)
    assert req.status == RequestStatus.FINISHED_STOPPED
    assert req.num_output_tokens == 3


def test_abort_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request("a", range(1, 30), max_tokens=50))
    sched.add_request(make_request("b", range(1, 9), max_tokens=50))
    run_step(sched)
    assert sched.kv_cache.num_free_blocks < 64
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert_pool_full(sched)
    so = sched.schedule()
    assert so.finished_req_ids == {"a", "b"}
    assert so.is_empty


def test_prefix_cache_hit_skips_shared_blocks():
    sched = make_scheduler()
    shared = list(range(100, 116))  # 4 full blocks
    sched.add_request(make_request("a", shared + [1, 2], max_tokens=1))
    run_step(sched)
    assert not sched.has_unfinished_requests()
    sched.add_request(make_request("b", shared + [3, 4, 5], max_tokens=1))
    so, _ = run_step(sched)
    assert so.new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens == {"b": 3}
    assert sched.kv_cache.prefix_cache_hits == 16
    assert_pool_full(sched)


def test_full_prompt_hit_still_computes_last_token():
    sched = make_scheduler()
    prompt = list(range(100, 108))  # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so, _ = run_step(sched)
    assert so.new_reqs[0].num_computed_tokens == 4
    assert so.num_scheduled_tokens == {"b": 4}


def test_shared_blocks_survive_while_referenced():
    sched = make_scheduler()
    prompt = list(range(100, 112)) + [1]
    sched.add_request(make_request("a", prompt, max_tokens=20))
    run_step(sched)
    sched.add_request(make_request("b", prompt[:-1] + [2], max_tokens=20))
    run_step(sched)
    blocks_a = sched.kv_cache.req_to_blocks["a"]
    blocks_b = sched.kv_cache.req_to_blocks["b"]
    assert blocks_a[:3] == blocks_b[:3]
    assert all(b.ref_cnt == 2 for b in blocks_a[:3])
    sched.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert all(b.ref_cnt == 1 for b in blocks_b[:3])
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    assert_pool_full(sched)


def test_lru_eviction_prefers_least_recently_freed():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("old", [1] * 8 + [2], max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("new", [3] * 8 + [4], max_tokens=1))
    run_step(sched)
    # Fill the pool enough to evict some cached blocks: the old ones go first.
    sched.add_request(make_request("big", list(range(10, 30)), max_tokens=1))
    run_step(sched)
    sched.add_request(make_request("probe", [3] * 8 + [5], max_tokens=1))
    so, _ = run_step(sched)
    assert so.new_reqs[0].num_computed_tokens == 8  # "new" prefix survived


def test_preemption_when_pool_runs_dry_and_recovery():
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add_request(make_request("a", [1] * 8, max_tokens=8))
    sched.add_request(make_request("b", [2] * 8, max_tokens=8))
    steps = 0
    preempted = False
    while sched.has_unfinished_requests():
        so, _ = run_step(sched)
        preempted |= bool(so.preempted_req_ids)
        steps += 1
        assert steps < 100
    assert preempted
    assert sched.num_preemptions >= 1
    assert_pool_full(sched)


def test_duplicate_request_id_rejected():
    sched = make_scheduler()
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", [1, 2]))


def test_block_hashes_follow_generated_tokens():
    sched = make_scheduler()
    req = make_request("r", [1] * 6, max_tokens=10)
    assert len(req.block_hashes) == 1
    sched.add_request(req)
    run_step(sched, token=2)  # the prompt, then its first sampled token
    run_step(sched, token=3)
    assert req.all_token_ids == [1] * 6 + [2, 3]
    assert len(req.block_hashes) == 2
    other = make_request("s", [1] * 6 + [2, 3])
    assert other.block_hashes == req.block_hashes


def test_queue_time_observed_once_per_request_at_first_admission(monkeypatch):
    import types

    import asyncllm.core.scheduler as scheduler_module

    # the scheduler's clock, stopped: queue times are exact
    now = 1_000_000.0
    monkeypatch.setattr(scheduler_module, "time", types.SimpleNamespace(time=lambda: now))
    sched = make_scheduler(num_blocks=6, budget=64)
    for rid in ("a", "b"):
        req = make_request(rid, [1] * 8, max_tokens=8)
        req.arrival_time = now - 2.25  # arrived 2.25 s ago
        sched.add_request(req)
    while sched.has_unfinished_requests():
        run_step(sched)
    assert sched.num_preemptions >= 1  # a preempted request is not counted again
    hist = sched.queue_time
    assert hist.count == 2
    assert hist.sum == 4.5  # each counted once, at its first admission
    assert hist.cumulative()[-1] == 2
    assert hist.cumulative()[5] == 0 and hist.cumulative()[6] == 2  # in the (2.0, 2.5] bucket
