"""The multiprocess tensor-parallel executor: rank 0 in the engine core, ranks
1..N-1 in worker processes it starts (`python -m asyncllm.executor.worker_proc`,
a fresh interpreter, as the core itself is started).

Start-up: the workers start loading their shards while rank 0 loads its own;
each reports b"R" (ready) or its error on a status pipe. Only when every rank
is ready does the group rendezvous (executor/distributed.py), so a rank that
fails to start is reported with its own error text and nobody waits on it.

Failure: after start-up the same pipe carries heartbeats. A watchdog thread
reads them: a worker whose pipe closes (it died) or that sends nothing for
`HANG_S` (hung: it is killed) is recorded as the executor's failure. The step
that meets the failure (a collective with the dead rank fails at once, as its
sockets close) raises an error naming the rank, which fails the engine core like
any runner error: every request gets EngineDeadError. Workers exit when the
core's process ends (their stdin closes), so none outlive it.

What does not depend on where the workers run (the join, the per-step calls, the
failure a step raises) is `TPExecutor`'s (executor/abstract.py); the Ray executor
(executor/ray_executor.py) is its other subclass.
"""

from __future__ import annotations

import dataclasses
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineStartupError
from asyncllm.executor.abstract import HANG_S, STOP_WAIT_S, TPExecutor
from asyncllm.executor.distributed import STORE_FILE, close_group, loopback_interface
from asyncllm.executor.worker_proc import status_error


@dataclasses.dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    fd: int  # the status pipe's read end
    buf: bytearray = dataclasses.field(default_factory=bytearray)
    ready: bool = False
    closed: bool = False
    last_seen: float = 0.0

    def error_text(self) -> str | None:
        """The error the worker wrote (b"E", length, text), if any."""
        return status_error(self.buf)

    def exit_text(self) -> str:
        code = self.proc.poll()
        if code is None:
            return "closed its status pipe"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"


class MultiprocExecutor(TPExecutor):
    """Ranks 1..N-1 as child processes of the core: a status pipe each, a
    FileStore rendezvous, gloo on loopback."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.dir = tempfile.mkdtemp(prefix="asyncllm-tp-")
        os.chmod(self.dir, 0o700)
        self.workers: list[_Worker] = []
        self._watchdog: threading.Thread | None = None

    # -- start-up --------------------------------------------------------------------

    def start(self) -> None:
        config_json = self.config.to_json()
        for rank in range(1, self.size):
            read_fd, write_fd = os.pipe()
            cmd = [
                sys.executable,
                "-m",
                "asyncllm.executor.worker_proc",
                "--config",
                config_json,
                "--rank",
                str(rank),
                "--size",
                str(self.size),
                "--store",
                os.path.join(self.dir, STORE_FILE),
                "--status-fd",
                str(write_fd),
            ]
            try:
                # stdin: a pipe we never write; EOF tells the worker we are gone
                proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, pass_fds=(write_fd,))
            finally:
                os.close(write_fd)
            self.workers.append(_Worker(rank, proc, read_fd))

    def rendezvous(self) -> tuple[Any, str]:
        path = os.path.join(self.dir, STORE_FILE)
        return torch.distributed.FileStore(path, self.size), loopback_interface()

    def start_watchdog(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            w.last_seen = now
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            left = deadline - time.monotonic()
            if left <= 0:
                waiting = [w.rank for w in self.workers if not w.ready]
                raise EngineStartupError(
                    f"tensor-parallel rank(s) {waiting} were not ready within {timeout:.0f}s"
                )
            fds = [w.fd for w in self.workers if not w.ready]
            readable, _, _ = select.select(fds, [], [], min(left, 1.0))
            for w in self.workers:
                if w.fd in readable:
                    self._read(w)
                    if w.buf[:1] == b"R":
                        w.ready = True
                        del w.buf[:1]
                    elif w.closed:
                        w.proc.wait(timeout=5)
                        reason = w.error_text() or f"it {w.exit_text()}"
                        raise EngineStartupError(
                            f"tensor-parallel rank {w.rank} failed to start: {reason}"
                        )

    # -- the watchdog ----------------------------------------------------------------

    def _read(self, w: _Worker) -> None:
        try:
            data = os.read(w.fd, 65536)
        except OSError:
            data = b""
        if not data:
            w.closed = True
        else:
            w.buf += data
            w.last_seen = time.monotonic()

    def _watch(self) -> None:
        live = list(self.workers)
        while live and not self._closing:
            readable, _, _ = select.select([w.fd for w in live], [], [], 0.25)
            now = time.monotonic()
            for w in list(live):
                if w.fd in readable:
                    self._read(w)
                    error = w.error_text()
                    if error is not None or w.closed:
                        if w.closed:
                            try:
                                w.proc.wait(timeout=1.0)
                            except subprocess.TimeoutExpired:
                                pass
                        reason = error or w.exit_text()
                        self._fail(
                            f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) failed: {reason}"
                        )
                        live.remove(w)
                        continue
                    if len(w.buf) > 4096:
                        del w.buf[:-8]  # heartbeats only: keep the tail
                elif now - w.last_seen > HANG_S:
                    w.proc.kill()  # its sockets close, so the step waiting on it fails
                    self._fail(
                        f"tensor-parallel rank {w.rank} (pid {w.proc.pid}) hung: no heartbeat "
                        f"for {now - w.last_seen:.1f}s, killed"
                    )
                    live.remove(w)

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (STOP if they are healthy, else kill), leave the group
        and remove the private directory. Idempotent."""
        if self._closing:
            return
        self._closing = True
        if not self._send_stop():  # EOF on stdin: a worker exits wherever it is
            for w in self.workers:
                if w.proc.stdin is not None:
                    w.proc.stdin.close()
        deadline = time.monotonic() + STOP_WAIT_S
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()
            if w.proc.stdin is not None:
                w.proc.stdin.close()
            os.close(w.fd)
        if self._watchdog is not None:
            self._watchdog.join(timeout=1.0)
        close_group()
        shutil.rmtree(self.dir, ignore_errors=True)
