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

`TPExecutor` holds what does not depend on where the workers run (the join, the
per-step calls, the failure a step raises); the Ray executor
(executor/ray_executor.py) is its other subclass.
"""

from __future__ import annotations

import dataclasses
import json
import logging
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
from asyncllm.executor.distributed import (
    STORE_FILE,
    close_group,
    init_group,
    loopback_interface,
    threads_per_rank,
)
from asyncllm.executor.step_channel import StepSender
from asyncllm.executor.worker_proc import status_error
from asyncllm.models.parallel_state import set_tensor_parallel
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)

HANG_S = 3.0  # a worker silent this long is hung (it beats every 0.25 s)
STARTUP_TIMEOUT_S = 600.0
_FAILURE_WAIT_S = 1.0  # how long a failed step waits for the watchdog's reason
_STOP_WAIT_S = 5.0


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


class TPExecutor:
    """Rank 0's handle on the workers, whatever starts them: join, the per-step
    messages (the runner's `TensorParallelDriver`), and the failure the watchdog
    records. Subclasses start the workers, wait for them, watch them, stop them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.sender: StepSender | None = None
        self.failure: str | None = None  # set once, by the watchdog
        self._closing = False

    def start(self) -> None:
        """Start ranks 1..N-1; they load their shards while rank 0 loads its own."""
        raise NotImplementedError

    def wait_ready(self, timeout: float) -> None:
        """Block until every worker has loaded its shard; EngineStartupError with
        the rank's own error text if one fails (or `timeout` passes)."""
        raise NotImplementedError

    def rendezvous(self) -> tuple[Any, str]:
        """Rank 0's store for the group's rendezvous, and the interface for gloo."""
        raise NotImplementedError

    def start_watchdog(self) -> None:
        """After the join: watch the workers, recording a death or hang in `failure`."""
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError

    def join(self, num_blocks: int) -> int:
        """Wait until every worker is ready, join the group, and return the KV
        block count all ranks can hold (the smallest)."""
        self.wait_ready(STARTUP_TIMEOUT_S)
        store, interface = self.rendezvous()
        group = init_group(store, 0, self.size, self.config.device, interface)
        agreed = torch.tensor([num_blocks], dtype=torch.int64)
        torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN, group=group)
        self.step_group = group
        self.start_watchdog()
        return int(agreed.item())

    # -- the runner's per-step calls (worker.model_runner.TensorParallelDriver) --------

    def wrap(self, model: Any) -> None:
        """Give the model's extra `compute_logits` calls (prompt logprobs) to the
        workers too; the sampled rows' logits they compute unasked."""
        sender = self.sender = StepSender(
            self.step_group, model.hidden_size, self.config.torch_dtype
        )
        inner = model.compute_logits

        def compute_logits(hidden: torch.Tensor) -> torch.Tensor:
            if sender.extra_logits:
                sender.send_rows(hidden)
            return inner(hidden)  # type: ignore[no-any-return]

        model.compute_logits = compute_logits

    def send_step(self, *inputs: Any) -> None:
        assert self.sender is not None
        self.sender.send_step(*inputs)

    def end_logits(self) -> None:
        assert self.sender is not None
        self.sender.end_logits()

    def step_error(self, exc: BaseException) -> BaseException:
        """The error a failed step raises: the watchdog's reason when a worker
        died or hung (it may take a moment to see it), else `exc` itself."""
        deadline = time.monotonic() + _FAILURE_WAIT_S
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if self.failure is None:
            return exc
        return RuntimeError(f"{self.failure} ({type(exc).__name__}: {exc})")

    def _fail(self, reason: str) -> None:
        if self._closing:
            return
        if self.failure is None:
            self.failure = reason
        logger.error("%s", reason)

    def _send_stop(self) -> bool:
        """STOP to healthy workers (they return from their step loop); False when
        a worker failed or STOP could not be sent."""
        if self.sender is None or self.failure is not None:
            return False
        try:
            self.sender.stop()
            return True
        except Exception as exc:  # a worker died meanwhile: stopped otherwise
            logger.warning("could not send STOP to the workers: %s", exc)
            return False


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
        config_json = json.dumps(dataclasses.asdict(self.config))
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
        deadline = time.monotonic() + _STOP_WAIT_S
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


class TPModelRunner(ModelRunner):
    """Rank 0's runner: the model runner, with the executor beside it. A step that
    fails because a worker died or hung raises the executor's reason."""

    def __init__(self, config: EngineConfig, hf_config: Any, executor: TPExecutor) -> None:
        self.executor = executor
        super().__init__(config, hf_config, tp=executor)
        # The step message carries the input ids from the host: with overlap
        # scheduling, sampled tokens must reach it before the next step is built
        # (not be patched in on the device, where the workers cannot see them).
        self._defer_tokens = False

    def execute_model(self, so: Any) -> ModelRunnerOutput:
        executor = self.executor
        if executor.failure is not None:
            raise RuntimeError(executor.failure)
        try:
            return super().execute_model(so)
        except Exception as exc:
            error = executor.step_error(exc)
            if error is exc:
                raise
            raise error from exc

    def shutdown(self) -> None:
        self.executor.shutdown()


def build_tp_runner(config: EngineConfig, hf_config: Any) -> TPModelRunner:
    """Rank 0's runner for `config.tensor_parallel_size` > 1, with its workers
    started (here, or by Ray: `config.distributed_executor_backend`); on any
    start-up failure the workers are stopped and the error (naming the rank that
    failed) is raised."""
    executor: TPExecutor
    if config.distributed_executor_backend == "ray":
        from asyncllm.executor.ray_executor import RayExecutor

        executor = RayExecutor(config)
    else:
        executor = MultiprocExecutor(config)
    try:
        executor.start()
        threads = threads_per_rank(config)
        if threads is not None:
            torch.set_num_threads(threads)
        # the sharded layers read it while the model is built (and only then: an
        # engine built later in this process with one rank builds whole layers)
        set_tensor_parallel(0, executor.size)
        try:
            return TPModelRunner(config, hf_config, executor)
        finally:
            set_tensor_parallel(0, 1)
    except BaseException:
        executor.shutdown()
        raise
