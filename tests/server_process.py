"""`asyncllm serve` as a real process on 127.0.0.1, and the plain-HTTP helpers the
server tests use to talk to it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """`asyncllm serve` in a subprocess, up once /health answers 200."""

    def __init__(self, log: Path, *args: str, env: dict[str, str] | None = None) -> None:
        """`args` follow `asyncllm serve` (model, flags); the port is chosen here;
        `env` adds environment variables to the server's."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", *args]
        cmd += ["--port", str(self.port)]
        self.log = log
        self._log_file = open(log, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, stdout=self._log_file, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
        )
        deadline = time.monotonic() + 90
        while http_status(self.url + "/health") != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)

    def children(self) -> list[int]:
        out = subprocess.run(
            ["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True
        ).stdout
        return [int(p) for p in out.split()]

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log_file.close()
        return self.proc.returncode


def http_status(url: str, headers: dict[str, str] | None = None) -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10):
            return 200
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def get_text(url: str, headers: dict[str, str] | None = None) -> str:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.read().decode()


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@contextmanager
def serving(log_dir: Path, model: Path, served_name: str, *flags: str) -> Iterator[Server]:
    """`asyncllm serve` of `model` in float32 under `served_name` with `flags`, its
    log in `log_dir`; stopped on exit, which must be clean (the log's tail says why
    not)."""
    log = log_dir / "server.log"
    s = Server(log, str(model), "--dtype", "float32", "--served-model-name", served_name, *flags)
    yield s
    assert s.stop() == 0, log.read_text()[-3000:]
