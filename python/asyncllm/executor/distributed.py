"""torch.distributed set-up for one tensor-parallel group.

On one machine (the multiprocess executor) the rendezvous is a `FileStore` in the
executor's private directory (mode 0700): no TCP store, which would listen on every
interface, and gloo's own sockets are bound to the loopback interface
(GLOO_SOCKET_IFNAME; NCCL_SOCKET_IFNAME for NCCL's bootstrap), so nothing of the
group is reachable from outside the host. Across machines (the Ray executor) the
store is rank 0's CURVE-secured hub (executor/hub.py) and gloo binds to the
interface that holds the address the ranks reach each other on
(`interface_of`, `interface_towards`).

Two groups: the default one carries the model's collectives (all-reduce,
logits gather) with `COLLECTIVE_TIMEOUT`, a backstop behind the executor's
heartbeat watchdog; `step_group` (gloo, host tensors, also under NCCL) carries
rank 0's step messages, on which idle workers wait as long as the engine idles.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.errors import ConfigError

COLLECTIVE_TIMEOUT = timedelta(seconds=120)
IDLE_TIMEOUT = timedelta(days=365)
STORE_FILE = "rendezvous"


def loopback_interface() -> str:
    """The loopback interface's name ("lo" on Linux, "lo0" on macOS)."""
    for _, name in socket.if_nameindex():
        if name.startswith("lo"):
            return name
    return "lo"


def interface_of(address: str) -> str:
    """The name of the local interface that holds IP `address` (Linux), for gloo's
    and NCCL's sockets; OSError naming the address when none does."""
    ip = ipaddress.ip_address(address)
    if ip.is_loopback:
        return loopback_interface()
    if ip.version == 6:
        with open("/proc/net/if_inet6") as f:  # addr index prefix scope flags name
            for line in f:
                parts = line.split()
                if len(parts) == 6 and int(parts[0], 16) == int(ip):
                    return parts[5]
    else:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    req = struct.pack("256s", name.encode()[:15])
                    got = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]
                except OSError:  # down, or no IPv4 address
                    continue
                if socket.inet_ntoa(got) == address:
                    return name
    raise OSError(f"no network interface of this machine holds the address {address}")


def host_address(default: Callable[[], str]) -> str:
    """The address this node's ranks are reached on: ASYNCLLM_HOST_IP where set
    (checked: an IP address some interface of this machine holds), else
    `default()` (Ray's address of the node)."""
    chosen = envs.host_ip()
    if chosen is None:
        return default()
    try:
        ipaddress.ip_address(chosen)
        interface_of(chosen)
    except ValueError:
        raise ConfigError(f"ASYNCLLM_HOST_IP={chosen!r} is not an IP address") from None
    except OSError:
        raise ConfigError(
            f"ASYNCLLM_HOST_IP={chosen!r} is not an address of this machine"
            " (no network interface holds it)"
        ) from None
    return chosen


def interface_towards(address: str) -> str:
    """The local interface this machine reaches `address` through (the route the
    kernel picks; a UDP connect sends nothing)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return interface_of(s.getsockname()[0])


def init_group(store: Any, rank: int, size: int, device: str, interface: str) -> Any:
    """Join the group through `store` (every rank calls this once), with gloo's
    (and NCCL's bootstrap) sockets on `interface` unless GLOO_SOCKET_IFNAME
    (NCCL_SOCKET_IFNAME) says otherwise, and return the step group."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialised in this process: one tensor-parallel "
            "engine per process (run the engine core in its own process)"
        )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", interface)
    os.environ.setdefault("NCCL_SOCKET_IFNAME", interface)
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
