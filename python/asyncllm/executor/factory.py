"""Rank 0's runner for tensor parallelism, and the factory that starts its executor.

`build_tp_runner` is the one entry point the engine core uses when
`tensor_parallel_size` > 1: it picks the executor (`distributed_executor_backend`),
starts the workers, builds rank 0's sharded model and returns its runner. The Ray
executor is imported only when asked for, so a local engine never imports Ray.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncllm.config import EngineConfig
from asyncllm.executor.abstract import TPExecutor
from asyncllm.executor.distributed import threads_per_rank
from asyncllm.executor.multiproc import MultiprocExecutor
from asyncllm.models.parallel_state import set_tensor_parallel
from asyncllm.worker.model_runner import ModelRunner
from asyncllm.worker.runner_output import ModelRunnerOutput


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


def make_executor(config: EngineConfig) -> TPExecutor:
    """The executor `config.distributed_executor_backend` names, not yet started."""
    if config.distributed_executor_backend == "ray":
        from asyncllm.executor.ray_executor import RayExecutor

        return RayExecutor(config)
    return MultiprocExecutor(config)


def build_tp_runner(config: EngineConfig, hf_config: Any) -> TPModelRunner:
    """Rank 0's runner for `config.tensor_parallel_size` > 1, with its workers
    started (here, or by Ray: `config.distributed_executor_backend`); on any
    start-up failure the workers are stopped and the error (naming the rank that
    failed) is raised."""
    executor = make_executor(config)
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
