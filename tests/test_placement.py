"""Placement settings of the engine core, on a real core process: `pin_threads`
splits the CPUs between the core and the front end (and gives them back at
shutdown), `omp_wait_policy` reaches the core's environment, bad values are named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.config import EngineArgs
from asyncllm.errors import ConfigError
from asyncllm.placement import placement


def _core_pid(llm: LLM) -> int:
    pid = llm.engine.client.process.pid
    assert pid is not None
    return pid


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_pinned_core_and_passive_wait_policy():
    ours = os.sched_getaffinity(0)
    last = max(ours)
    with LLM(num_threads=1, pin_threads=True, omp_wait_policy="passive") as llm:
        pid = _core_pid(llm)
        out = llm.generate(["pinned"], SamplingParams(max_tokens=4), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        assert len(tasks) > 1  # IO threads, the OpenMP team: all started after the pin
        assert all(os.sched_getaffinity(int(t.name)) == {last} for t in tasks)
        assert os.sched_getaffinity(0) == ours - {last}
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        assert b"OMP_WAIT_POLICY=PASSIVE" in environ
    assert os.sched_getaffinity(0) == ours


def test_offline_core_keeps_libgomps_own_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("ASYNCLLM_OMP_WAIT_POLICY", raising=False)
    with LLM() as llm:
        environ = Path(f"/proc/{_core_pid(llm)}/environ").read_bytes().split(b"\0")
        assert not any(v.startswith(b"OMP_WAIT_POLICY=") for v in environ)


def test_placement_settings_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="omp_wait_policy"):
        EngineArgs(omp_wait_policy="spin")
    with pytest.raises(ConfigError, match="pin_threads"):
        EngineArgs(pin_threads=True, data_parallel_size=2)
    monkeypatch.setenv("ASYNCLLM_OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("ASYNCLLM_PIN_THREADS", "1")
    args = EngineArgs()
    assert (args.omp_wait_policy, args.pin_threads) == ("passive", True)


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


@pytest.mark.parametrize("entry", ["serve", "async"])
def test_streaming_entry_points_fill_only_what_the_user_left(monkeypatch, entry):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = _cpus()
    auto = placement(EngineArgs(), entry)
    assert auto.num_threads == max(1, cpus - 1)
    assert auto.pin_threads is (cpus > 1)
    mine = placement(EngineArgs(num_threads=cpus, pin_threads=None), entry)
    assert (mine.num_threads, mine.pin_threads) == (cpus, False)
    assert placement(EngineArgs(pin_threads=False), entry).pin_threads is False
    parallel = EngineArgs(data_parallel_size=2)
    assert placement(parallel, entry) == EngineArgs(data_parallel_size=2, omp_wait_policy="passive")
    assert auto.omp_wait_policy == "passive"  # idle workers leave the front end its CPU
    # a core in a thread of this process cannot be pinned apart from it
    in_thread = placement(EngineArgs(), entry, in_process=True)
    assert (in_thread.num_threads, in_thread.pin_threads) == (max(1, cpus - 1), False)


def test_offline_keeps_torchs_default_and_omp_num_threads_wins(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # torch's threads, unpinned, and libgomp's spin-then-sleep: the front end idles
    assert placement(EngineArgs(), "offline") == EngineArgs(omp_wait_policy="inherit")
    assert placement(EngineArgs(omp_wait_policy="passive"), "offline").omp_wait_policy == "passive"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert placement(EngineArgs(), "async") == EngineArgs(omp_wait_policy="passive")


def test_cpu_bind_overrides_the_policy(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    last = max(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
    bound = placement(EngineArgs(cpu_bind=str(last)), "offline")
    assert (bound.num_threads, bound.pin_threads) == (1, True)
    free = placement(EngineArgs(cpu_bind="nobind"), "serve")
    assert (free.num_threads, free.pin_threads) == (None, False)
    with pytest.raises(ConfigError, match="cpu_bind"):
        EngineArgs(cpu_bind="0-")
    with pytest.raises(ConfigError, match="cpu_bind"):
        placement(EngineArgs(cpu_bind="4000"), "serve")
    monkeypatch.setenv("ASYNCLLM_CPU_OMP_THREADS_BIND", "nobind")
    assert EngineArgs().cpu_bind == "nobind"


@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs CPU affinity and two CPUs",
)
def test_async_llm_by_default_leaves_the_front_end_a_cpu(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    from asyncllm import AsyncLLM

    ours = os.sched_getaffinity(0)
    engine = AsyncLLM(EngineArgs())
    try:
        pid = engine.client.process.pid
        core = os.sched_getaffinity(pid)
        assert len(core) == len(ours) - 1
        assert os.sched_getaffinity(0) == ours - core
    finally:
        engine.shutdown()
    assert os.sched_getaffinity(0) == ours
