"""Placement settings of the engine core, on a real core process: `pin_threads`
splits the CPUs between the core and the front end (and gives them back at
shutdown), `omp_wait_policy` reaches the core's environment, bad values are named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm.config import EngineArgs, serving_placement
from asyncllm.errors import ConfigError


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


def test_placement_settings_are_checked(monkeypatch):
    with pytest.raises(ConfigError, match="omp_wait_policy"):
        EngineArgs(omp_wait_policy="spin")
    with pytest.raises(ConfigError, match="pin_threads"):
        EngineArgs(pin_threads=True, data_parallel_size=2)
    monkeypatch.setenv("ASYNCLLM_OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("ASYNCLLM_PIN_THREADS", "1")
    args = EngineArgs()
    assert (args.omp_wait_policy, args.pin_threads) == ("passive", True)


def test_serving_placement_fills_only_what_the_user_left(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    auto = serving_placement(EngineArgs())
    assert auto.num_threads == max(1, cpus - 1)
    assert auto.pin_threads is (cpus > 1)
    mine = serving_placement(EngineArgs(num_threads=cpus, pin_threads=None))
    assert (mine.num_threads, mine.pin_threads) == (cpus, False)
    assert serving_placement(EngineArgs(pin_threads=False)).pin_threads is False
    parallel = EngineArgs(data_parallel_size=2)
    assert serving_placement(parallel) == parallel
