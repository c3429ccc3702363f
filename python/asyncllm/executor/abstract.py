"""The tensor-parallel executor's interface: rank 0's handle on ranks 1..N-1,
whatever starts them (`multiproc.MultiprocExecutor` on this machine,
`ray_executor.RayExecutor` on a Ray cluster; `factory.build_tp_runner` picks one).

What lives here does not depend on where the workers run: the join (every rank
ready, the group rendezvous, the smallest KV block count), the per-step calls the
runner makes (`worker.model_runner.TensorParallelDriver`), and the failure a step
raises when the watchdog has seen a worker die or hang. A subclass starts the
workers, waits for them, watches them and stops them.
"""

from __future__ import annotations

import abc
import logging
import time
from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.executor.distributed import init_group
from asyncllm.executor.step_channel import StepSender

logger = logging.getLogger(__name__)

HANG_S = 3.0  # a worker silent this long is hung (it beats every 0.25 s)
STARTUP_TIMEOUT_S = 600.0
STOP_WAIT_S = 5.0  # how long shutdown waits for the workers before killing them
_FAILURE_WAIT_S = 1.0  # how long a failed step waits for the watchdog's reason


class TPExecutor(abc.ABC):
    """Rank 0's handle on the workers, whatever starts them: join, the per-step
    messages (the runner's `TensorParallelDriver`), and the failure the watchdog
    records. Subclasses start the workers, wait for them, watch them, stop them."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.size = config.tensor_parallel_size
        self.sender: StepSender | None = None
        self.failure: str | None = None  # set once, by the watchdog
        self._closing = False

    @abc.abstractmethod
    def start(self) -> None:
        """Start ranks 1..N-1; they load their shards while rank 0 loads its own."""

    @abc.abstractmethod
    def wait_ready(self, timeout: float) -> None:
        """Block until every worker has loaded its shard; EngineStartupError with
        the rank's own error text if one fails (or `timeout` passes)."""

    @abc.abstractmethod
    def rendezvous(self) -> tuple[Any, str]:
        """Rank 0's store for the group's rendezvous, and the interface for gloo."""

    @abc.abstractmethod
    def start_watchdog(self) -> None:
        """After the join: watch the workers, recording a death or hang in `failure`."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and leave the group; idempotent."""

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
