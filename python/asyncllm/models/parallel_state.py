"""This process's place in a tensor-parallel group: its rank and the group's size.

The executor (asyncllm.executor) sets them before the model is built, so the
Llama family builds its sharded layers (models/parallel_layers.py); the
collectives those layers run go through torch.distributed's default group, which
the executor initialises once every rank has loaded its shard. With one rank
(the default) nothing here is used and torch.distributed is never imported.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1


_STATE = TensorParallel()


def tensor_parallel() -> TensorParallel:
    """The process's tensor-parallel rank and size (0 and 1 without parallelism)."""
    return _STATE


def set_tensor_parallel(rank: int, size: int) -> None:
    """Called by the executor once per process, before the model is built."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is outside a group of {size}")
    _STATE.rank, _STATE.size = rank, size
