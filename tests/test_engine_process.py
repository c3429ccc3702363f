"""The engine-core process's life cycle: start-up errors, no `__main__` guard,
parent death, and shutdown that leaves no process, socket or file behind."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from asyncllm import AsyncLLM, EngineArgs, EngineStartupError, SamplingParams
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def child_pids() -> set[int]:
    me = os.getpid()
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z":
            pids.add(int(entry))
    return pids


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_start_stop_twenty_times_leaks_nothing(model_dir):
    args = EngineArgs(model=str(model_dir), executor="null")

    async def cycle():
        engine = AsyncLLM.from_engine_args(args)
        socket_dir = engine.client.process.socket_dir
        assert oct(os.stat(socket_dir).st_mode & 0o777) == "0o700"
        async for _ in engine.generate([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)):
            pass
        engine.shutdown()
        engine.shutdown()
        return socket_dir

    asyncio.run(cycle())  # warm-up: lazy imports open files once
    fds, threads, children = open_fds(), threading.active_count(), child_pids()
    dirs = [asyncio.run(cycle()) for _ in range(20)]
    time.sleep(0.2)
    assert child_pids() == children
    assert open_fds() <= fds
    assert threading.active_count() <= threads
    assert not any(Path(d).exists() for d in dirs)


def test_startup_failure_reports_the_root_cause(model_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in model_dir.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    children = child_pids()
    with pytest.raises(EngineStartupError, match="unsupported architecture GPT2LMHeadModel"):
        AsyncLLM.from_engine_args(EngineArgs(model=str(bad)))
    assert child_pids() == children


def run_script(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_llm_script_without_main_guard_runs_multiprocess(model_dir):
    result = run_script(
        f"""
        from asyncllm import LLM, SamplingParams
        llm = LLM({str(model_dir)!r}, dtype="float32")
        assert llm.engine.client is not None and llm.engine.client.process.pid is not None
        out = llm.generate(["Hello"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        print("TOKENS", len(out[0].outputs[0].token_ids))
        """
    )
    assert result.returncode == 0, result.stderr
    assert "TOKENS 4" in result.stdout


def test_core_exits_when_the_front_end_is_killed(model_dir):
    script = textwrap.dedent(
        f"""
        import sys, time
        from asyncllm import LLM
        llm = LLM({str(model_dir)!r}, executor="null")
        print(llm.engine.client.process.pid, flush=True)
        time.sleep(600)
        """
    )
    front = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(front.stdout.readline())
        assert pid_alive(core_pid)
        front.kill()
        front.wait()
        deadline = time.monotonic() + 5
        while pid_alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(core_pid), "the engine core outlived its front end"
    finally:
        front.kill()
