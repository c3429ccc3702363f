"""`asyncllm serve` when things go wrong, as real processes: a SIGTERM to the whole
process group (systemd, `kill -- -PGID`, a container stop) drains the streams and
exits 0; an engine core killed under the server fails the in-flight requests with
503 and the server then exits non-zero, so that a supervisor restarts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from server_process import free_port, http_status, post
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

MODEL = "tiny"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


class GroupServer:
    """`asyncllm serve` as the leader of its own process group (as under systemd)."""

    def __init__(self, model_dir: Path, log: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(model_dir)]
        cmd += ["--served-model-name", MODEL, "--port", str(self.port)]
        # The null executor paced at 20 ms a step: streams last a known while, on
        # however loaded a machine.
        cmd += ["--executor", "null", "--null-step-delay-ms", "20"]
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            [*cmd, *extra], stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + 90
        while http_status(self.url + "/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def core_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True)
        (pid,) = (int(p) for p in out.stdout.split())
        return pid

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._log_file.close()


def client_for(srv: GroupServer):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_sigterm_to_the_process_group_drains_streams_and_exits_0(model_dir, tmp_path):
    srv = GroupServer(model_dir, tmp_path / "server.log", "--shutdown-timeout", "120")
    try:
        client = client_for(srv)
        core = srv.core_pid()
        results: dict[int, tuple[str | None, int]] = {}
        first_chunk = [threading.Event() for _ in range(3)]

        def stream(i: int) -> None:
            chunks = client.completions.create(
                model=MODEL,
                prompt=f"Once {i}",
                max_tokens=100,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            reason, tokens = None, 0
            for chunk in chunks:
                first_chunk[i].set()
                if chunk.choices and chunk.choices[0].finish_reason:
                    reason = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
            results[i] = (reason, tokens)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for ev in first_chunk:
            assert ev.wait(60)
        os.killpg(srv.proc.pid, signal.SIGTERM)  # the server and its engine core alike
        for t in threads:
            t.join(120)
        assert results == {i: ("length", 100) for i in range(3)}, srv.log.read_text()[-3000:]
        assert srv.proc.wait(60) == 0, srv.log.read_text()[-3000:]
        deadline = time.monotonic() + 10
        while not gone(core) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(core)
    finally:
        srv.close()


def test_a_killed_core_gets_503s_then_the_server_exits_1(model_dir, tmp_path):
    srv = GroupServer(model_dir, tmp_path / "server.log")
    try:
        client = client_for(srv)
        answers: dict[str, object] = {}

        def whole() -> None:
            answers["whole"] = post(
                srv.url + "/v1/completions",
                {"prompt": "Once", "max_tokens": 1000, "ignore_eos": True},
            )

        def streamed() -> None:
            chunks = client.completions.create(
                model=MODEL, prompt="Twice", max_tokens=1000, stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            try:
                for _ in chunks:
                    answers.setdefault("stream_started", True)
                answers["stream"] = "ended without an error"
            except openai.APIError as exc:
                answers["stream"] = exc.message

        threads = [threading.Thread(target=whole), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while "stream_started" not in answers and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # the non-streamed request is in the engine too by now
        os.kill(srv.core_pid(), signal.SIGKILL)
        for t in threads:
            t.join(30)
        status, body = answers["whole"]
        assert status == 503 and body["error"]["code"] == "engine_dead"
        assert body["error"]["message"] == "the engine is not running"  # no core internals
        assert "engine is not running" in str(answers["stream"])
        assert srv.proc.wait(30) == 1, srv.log.read_text()[-3000:]
        assert "the engine died" in srv.log.read_text()
    finally:
        srv.close()
