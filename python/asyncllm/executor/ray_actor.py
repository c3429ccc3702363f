"""What Ray runs on a worker's node for the Ray executor (executor/ray_executor.py),
kept apart from it so that a Ray worker process imports neither torch nor the model
stack just to start the real worker: that costs seconds of each rank's start-up."""

from __future__ import annotations

import os
import subprocess
import sys

from asyncllm.executor.worker_proc import WORKER_KEYS_ENV


class WorkerSupervisor:
    """Ray actor: runs one tensor-parallel worker process on its node and waits for it."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None

    def run(self, argv: list[str], keys: str) -> int:
        """Start `python -m asyncllm.executor.worker_proc ARGV` with the CURVE keys in
        its environment (not on its command line); return its exit status."""
        cmd = [sys.executable, "-m", "asyncllm.executor.worker_proc", *argv]
        env = dict(os.environ, **{WORKER_KEYS_ENV: keys})
        # stdin: a pipe this actor holds; the worker exits when the actor's process ends.
        self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env, close_fds=True)
        return self._proc.wait()

    def pid(self) -> int | None:
        """The worker process's pid on its node."""
        return self._proc.pid if self._proc is not None else None

    def kill_worker(self) -> None:
        """Kill the worker process (a hung one may be stopped, deaf to its stdin)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()


def visible_devices() -> str:
    """In a Ray task holding one GPU: the GPU it was given (as CUDA numbers it)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES", "")
