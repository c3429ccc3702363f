"""Starting the engine-core process and cleaning up after it.

The core runs in a fresh interpreter (`python -m asyncllm.engine.core_proc`), not
a fork and not multiprocessing's re-import of the user's `__main__`, so scripts
need no `if __name__ == "__main__":` guard. Its sockets live in a private
directory (mode 0700) that is removed at shutdown; nothing listens on TCP.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from asyncllm.config import EngineArgs
from asyncllm.config_rules import parse_cpu_list
from asyncllm.engine.ray_launcher import cluster_environment

logger = logging.getLogger(__name__)


class CoreProcess:
    """The engine-core child process and its socket directory."""

    def __init__(self, args: EngineArgs) -> None:
        self.socket_dir = tempfile.mkdtemp(prefix="asyncllm-")
        os.chmod(self.socket_dir, 0o700)
        self.input_addr = f"ipc://{self.socket_dir}/input.sock"
        self.output_addr = f"ipc://{self.socket_dir}/output.sock"
        self._args = args
        self.proc: subprocess.Popen[bytes] | None = None
        self._unpinned: set[int] | None = None  # our CPUs before pin_threads moved us

    def start(self) -> None:
        """Spawn the child; the caller must have bound both addresses already."""
        cmd = [
            sys.executable,
            "-m",
            "asyncllm.engine.core_proc",
            "--engine-args",
            self._args.to_json(),
            "--input",
            self.input_addr,
            "--output",
            self.output_addr,
            "--watch-stdin",
        ]
        # stdin is a pipe we never write: when this process dies the child sees EOF.
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, close_fds=True, env=core_environment(self._args)
        )
        if self._args.pin_threads:
            bound = parse_cpu_list(self._args.cpu_bind)
            self._unpinned = pin(self.proc.pid, self._args.num_threads, bound)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def wait(self) -> int:
        assert self.proc is not None
        return self.proc.wait()

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for the child to exit (after SHUTDOWN), else close its stdin (it
        exits on EOF; it ignores SIGTERM), else kill it. Removes the socket
        directory. Idempotent."""
        proc = self.proc
        if proc is not None:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not exit in %.1fs; stopping it", timeout)
                if proc.stdin is not None:
                    proc.stdin.close()
                try:
                    proc.wait(timeout=2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            if proc.stdin is not None:
                proc.stdin.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if self._unpinned is not None:
            _set_process_affinity(self._unpinned)
            self._unpinned = None


def core_environment(args: EngineArgs) -> dict[str, str]:
    """The core's environment: ours, plus the OpenMP wait policy asked for (over
    any OMP_WAIT_POLICY of ours unless "inherit"), which libgomp reads once when
    torch loads in the fresh interpreter, and the Ray cluster to join where Ray
    places its tensor-parallel workers."""
    env = dict(os.environ, **cluster_environment(args))
    policy = "passive" if args.omp_wait_policy == "auto" else args.omp_wait_policy
    if policy != "inherit":
        env["OMP_WAIT_POLICY"] = policy.upper()
    return env


def pin(
    core_pid: int, num_threads: int | None, cpus_of_core: list[int] | None = None
) -> set[int] | None:
    """Pin the core to `cpus_of_core` (`cpu_bind`), else to the last `num_threads` of
    our CPUs, and this process (the front end, the server) to the others; returns
    our CPUs before (restored at stop), or None when nothing moved. Set on the
    core's first thread right after the spawn, before its interpreter has started
    any other, so every thread it makes (IO threads, the OpenMP team) inherits it.
    A no-op when the core would get every CPU (or off Linux)."""
    if not hasattr(os, "sched_setaffinity"):
        logger.warning("pin_threads: this platform cannot set CPU affinity; not pinned")
        return None
    before = os.sched_getaffinity(0)
    cpus = sorted(before)
    n = num_threads or len(cpus)
    if cpus_of_core is not None:
        core = [c for c in cpus if c in cpus_of_core]
        front = [c for c in cpus if c not in cpus_of_core] or cpus
    elif n >= len(cpus):
        return None
    else:
        core, front = cpus[-n:], cpus[:-n]
    os.sched_setaffinity(core_pid, core)
    _set_process_affinity(set(front))
    logger.info("pinned the engine core to CPUs %s and the front end to %s", core, front)
    return before


def _set_process_affinity(cpus: set[int]) -> None:
    """Every thread of this process onto `cpus` (sched_setaffinity moves one thread)."""
    for task in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # a thread that ended meanwhile
            pass
