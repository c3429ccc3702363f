"""torch.distributed set-up for one tensor-parallel group on one machine.

The rendezvous is a `FileStore` in the executor's private directory (mode
0700): no TCP store, which would listen on every interface. Gloo's own sockets
are bound to the loopback interface (GLOO_SOCKET_IFNAME; NCCL_SOCKET_IFNAME for
NCCL's bootstrap), so nothing of the group is reachable from outside the host.

Two groups: the default one carries the model's collectives (all-reduce,
logits gather) with `COLLECTIVE_TIMEOUT`, a backstop behind the executor's
heartbeat watchdog; `step_group` (gloo, host tensors, also under NCCL) carries
rank 0's step messages, on which idle workers wait as long as the engine idles.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from asyncllm.config import EngineConfig

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
IDLE_TIMEOUT = timedelta(days=365)
STORE_FILE = "rendezvous"


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def init_group(store_path: str, rank: int, size: int, device: str) -> Any:
    """Join the group (every rank calls this once) and return the step group."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process (run the engine core in its own process)"
        )
    lo = loopback_interface()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", lo)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    store = dist.FileStore(store_path, size)
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=size, timeout=COLLECTIVE_TIMEOUT
    )
    if backend == "gloo":
        return dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT)
    return dist.new_group(list(range(size)), timeout=IDLE_TIMEOUT, backend="gloo")


def close_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def threads_per_rank(config: EngineConfig) -> int | None:
    """`num_threads`, else the machine's CPUs shared out among the ranks (torch's
    default, one per core, would make N ranks fight over the same cores), unless
    OMP_NUM_THREADS says how many (None: torch's default then), as for
    data-parallel cores."""
    if config.num_threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.tensor_parallel_size)
