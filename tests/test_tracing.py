"""The per-step timeline and the profiler endpoints, on a real server process:
`--trace-dir` makes the engine core and the front end each write a Chrome
trace-event file that parses, in which every core step holds its phases nested
and in order, on one clock with the front end's events; with tracing off nothing
is written; `/start_profile` and `/stop_profile` write a torch profile into
`--profile-dir`, and answer 404 without it."""

from __future__ import annotations

import bisect
import json
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from asyncllm import EngineArgs, SamplingParams
from asyncllm.cli.main import main
from asyncllm.engine.core import build_engine_core
from asyncllm.errors import ConfigError
from asyncllm.messages import EngineCoreRequest
from asyncllm.tracing import Tracer, now_ns
from server_process import Server, post
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)

API_KEY = "sk-trace-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
NUM_REQUESTS = 6
MAX_TOKENS = 12

# The core's phases, in the order they run, and where each one nests.
STEP_PHASES = ["schedule", "execute", "update"]
EXECUTE_PHASES = ["prepare_inputs", "forward", "logits", "sample", "outputs"]


@pytest.fixture(scope="module", autouse=True)
def serial_stepping():
    """These tests read serial steps (a `step` span holding its phases); overlap
    scheduling's timeline is checked in test_overlap.py. Pinned here so that the
    module also runs under ASYNCLLM_ASYNC_SCHEDULING=1."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ASYNCLLM_ASYNC_SCHEDULING", "0")
        yield


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def completion(url: str, prompt: str, **extra: Any) -> tuple[int, dict]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    return post(url + "/v1/completions", {**body, **extra}, AUTH)


def tiny_server(log: Path, model_dir: Path, *extra: str) -> Server:
    """`asyncllm serve` of the tiny model, behind the test's API key."""
    args = ("--dtype", "float32", "--served-model-name", "tiny", "--api-key", API_KEY)
    return Server(log, str(model_dir), *args, *extra)


@pytest.fixture(scope="module")
def traced_run(model_dir, tmp_path_factory):
    """A server with --trace-dir and --profile-dir: concurrent completions, a
    profile window around some of them, then SIGTERM (the files are final)."""
    tmp = tmp_path_factory.mktemp("traced")
    trace_dir, profile_dir = tmp / "trace", tmp / "profile"
    srv = tiny_server(
        tmp / "server.log",
        model_dir,
        "--trace-dir",
        str(trace_dir),
        "--profile-dir",
        str(profile_dir),
    )
    results: dict[str, Any] = {"server": srv, "trace_dir": trace_dir, "profile_dir": profile_dir}
    try:
        results["no_key"] = post(srv.url + "/start_profile", {})[0]
        results["stop_before_start"] = post(srv.url + "/stop_profile", {}, AUTH)
        results["start"] = post(srv.url + "/start_profile", {}, AUTH)
        results["start_again"] = post(srv.url + "/start_profile", {}, AUTH)
        answers: list[tuple[int, dict]] = []

        def one(i: int) -> None:
            answers.append(completion(srv.url, f"hello number {i} " * (i + 1)))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results["answers"] = answers
        results["stop"] = post(srv.url + "/stop_profile", {}, AUTH)
    finally:
        results["exit_code"] = srv.stop()
    return results


def load(trace_dir: Path, role: str) -> list[dict[str, Any]]:
    files = sorted(trace_dir.glob(f"{role}-*.json"))
    assert len(files) == 1, f"one {role} trace expected, found {files}"
    data = json.loads(files[0].read_text())
    events = data["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events)
    return events


def spans(events: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    found = [e for e in events if e["ph"] == "X" and e["name"] == name]
    return sorted(found, key=lambda e: e["ts"])


def inside(child: dict[str, Any], parent: dict[str, Any]) -> bool:
    # timestamps are microseconds from integer nanoseconds: allow their rounding
    eps = 1e-3
    return (
        child["tid"] == parent["tid"]
        and child["ts"] >= parent["ts"] - eps
        and child["ts"] + child["dur"] <= parent["ts"] + parent["dur"] + eps
    )


def children_in_order(
    events: list[dict[str, Any]], parent: dict[str, Any], names: list[str]
) -> list[dict[str, Any]]:
    found = sorted(
        (e for e in events if e["name"] in names and inside(e, parent)), key=lambda e: e["ts"]
    )
    for a, b in zip(found, found[1:], strict=False):
        assert a["ts"] + a["dur"] <= b["ts"] + 1e-3, f"{a['name']} overlaps {b['name']}"
    return found


def test_the_server_served_and_both_processes_wrote_a_trace(traced_run):
    assert traced_run["exit_code"] == 0, traced_run["server"].log.read_text()[-3000:]
    assert [status for status, _ in traced_run["answers"]] == [200] * NUM_REQUESTS
    core = load(traced_run["trace_dir"], "core")
    front = load(traced_run["trace_dir"], "frontend")
    core_pid = {e["pid"] for e in core}
    front_pid = {e["pid"] for e in front}
    assert len(core_pid) == 1 and len(front_pid) == 1 and core_pid != front_pid
    names = {e["args"]["name"] for e in core + front if e["name"] == "process_name"}
    assert names == {"core", "frontend"}
    for name in ("receive", "decode", "detokenize", "update_requests", "collect"):
        assert spans(front, name), f"the front end recorded no {name!r} span"
    for name in ("encode", "send", "handoff"):
        assert spans(core, name), f"the core recorded no {name!r} span"


def test_every_step_has_its_phases_nested_and_in_order(traced_run):
    core = load(traced_run["trace_dir"], "core")
    steps = spans(core, "step")
    assert len(steps) >= MAX_TOKENS  # at least one step per generated token
    generated = 0
    for step in steps:
        phases = children_in_order(core, step, STEP_PHASES)
        assert [p["name"] for p in phases] == STEP_PHASES, step
        execute = phases[1]
        inner = children_in_order(core, execute, EXECUTE_PHASES)
        inner_names = [p["name"] for p in inner]
        # a step that only prefills part of a prompt samples nothing
        assert inner_names in (EXECUTE_PHASES, EXECUTE_PHASES[:2]), inner_names
        assert step["args"]["batch"] >= 1 and step["args"]["tokens"] >= step["args"]["batch"]
        assert inner[1]["args"]["tokens"] == step["args"]["tokens"]
        generated += step["args"]["outputs"]
    assert generated == NUM_REQUESTS * MAX_TOKENS


def test_core_and_front_end_share_one_clock(traced_run):
    """Every frame the front end received was sent by the core shortly before,
    on the same clock: a send span starts before each receive span, and the
    two processes' step-time spans overlap."""
    core = load(traced_run["trace_dir"], "core")
    front = load(traced_run["trace_dir"], "frontend")
    sends = [e["ts"] for e in spans(core, "send")]
    receives = spans(front, "receive")
    assert receives and len(receives) <= len(sends)
    for r in receives:
        i = bisect.bisect_right(sends, r["ts"] + 1e-3)
        assert i > 0, "a frame was received before the core sent anything"
        assert r["ts"] - sends[i - 1] < 5e6, "no send within 5 s before this receive"
    steps, batches = spans(core, "step"), spans(front, "process_batch")
    core_range = (steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"])
    front_range = (batches[0]["ts"], batches[-1]["ts"] + batches[-1]["dur"])
    assert core_range[0] < front_range[1] and front_range[0] < core_range[1]


def test_profile_endpoints_write_a_torch_trace(traced_run):
    assert traced_run["no_key"] == 401
    status, body = traced_run["stop_before_start"]
    assert status == 409 and "no profile is running" in body["error"]["message"]
    assert traced_run["start"] == (200, {"profiling": True})
    status, body = traced_run["start_again"]
    assert status == 409 and "already running" in body["error"]["message"]
    status, body = traced_run["stop"]
    assert status == 200 and body["profiling"] is False and body["num_steps"] >= MAX_TOKENS
    path = Path(body["trace"])
    assert path.parent == traced_run["profile_dir"] and path.is_file()
    events = json.loads(path.read_text())["traceEvents"]
    ranges = {e.get("name") for e in events}
    assert {"step", *STEP_PHASES, *EXECUTE_PHASES} <= ranges


def test_without_profile_dir_the_endpoints_are_not_there(model_dir, tmp_path):
    srv = tiny_server(tmp_path / "server.log", model_dir)
    try:
        assert post(srv.url + "/start_profile", {}, AUTH)[0] == 404
        assert post(srv.url + "/stop_profile", {}, AUTH)[0] == 404
        assert completion(srv.url, "hello")[0] == 200
    finally:
        assert srv.stop() == 0


def test_tracing_off_records_and_writes_nothing(model_dir, tmp_path, monkeypatch):
    """Off by default: the step has no recorder (no clock reads, no timers), the
    runner neither, and no file appears."""
    monkeypatch.delenv("ASYNCLLM_TRACE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    core = build_engine_core(EngineArgs(model=str(model_dir), dtype="float32"))
    assert core.recorder is None and core.runner.recorder is None  # type: ignore[union-attr]
    assert core.tracer is None and core.step_timings is None
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    core.add_request(EngineCoreRequest(0, [1, 5, 7], params))
    while core.has_unfinished_requests():
        core.step()
    core.close()
    assert list(tmp_path.iterdir()) == []


def test_env_variable_turns_tracing_on(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCLLM_TRACE_DIR", str(tmp_path / "env-trace"))
    args = EngineArgs(model=str(model_dir), dtype="float32", collect_step_timings=True)
    assert args.trace_dir == str(tmp_path / "env-trace")
    core = build_engine_core(args)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(EngineCoreRequest(0, [1, 5, 7], params))
    while core.has_unfinished_requests():
        core.step()
    core.close()
    events = load(tmp_path / "env-trace", "core")
    assert len(spans(events, "step")) == 3
    assert [t[4] for t in core.step_timings or ()] == [1, 1, 1]  # the timers too


def test_offline_llm_writes_both_halves(model_dir, tmp_path):
    """`LLM` (its core in its own process) traces the front end too."""
    from asyncllm import LLM

    trace = tmp_path / "offline"
    with LLM(str(model_dir), dtype="float32", trace_dir=str(trace)) as llm:
        llm.generate([[1, 5, 7]] * 3, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    assert spans(load(trace, "core"), "step")
    assert spans(load(trace, "frontend"), "detokenize")


def test_the_buffer_keeps_the_latest_events_and_is_written_while_running(tmp_path):
    """Bounded: the oldest events go first. A background writer leaves a whole
    file behind even when the process never closes its tracer (a crash)."""
    tracer = Tracer(str(tmp_path), "unit", max_events=10, flush_interval_s=0.05)
    for i in range(25):
        t = now_ns()
        tracer.complete(f"e{i}", t, t + 1000, {"i": i})
    path = Path(tracer.path)
    deadline = now_ns() + 10**10
    while not path.exists() and now_ns() < deadline:
        threading.Event().wait(0.02)
    names = [e["name"] for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [n for n in names if n.startswith("e")] == [f"e{i}" for i in range(15, 25)]
    tracer.close()
    assert not list(tmp_path.glob("*.tmp"))
    assert path.name == f"unit-{os.getpid()}.json"


def test_a_trace_dir_that_cannot_be_made_is_a_config_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ConfigError, match="trace_dir"):
        Tracer(str(blocker / "trace"), "core")


def test_bench_overhead_writes_a_trace(model_dir, tmp_path, capsys):
    trace_dir = tmp_path / "bench-trace"
    argv = ["bench", "overhead", str(model_dir), "--num-streams", "4", "--output-len", "8"]
    assert main([*argv, "--trace-dir", str(trace_dir), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["trace_dir"] == str(trace_dir)
    steps = spans(load(trace_dir, "core"), "step")
    assert sum(s["args"]["outputs"] for s in steps) == 4 * 8
    assert spans(load(trace_dir, "frontend"), "process_batch")
