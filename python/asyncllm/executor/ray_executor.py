"""The Ray tensor-parallel executor (`distributed_executor_backend="ray"`): rank 0 in
the engine core, ranks 1..N-1 placed by Ray on the nodes of a Ray cluster.

Placement: a placement group with one bundle per rank, as vLLM lays it out: bundle 0
on the core's own node (a `ray.io/node-id` label selector) reserves rank 0's CPUs or
GPU there; bundles 1..N-1 go wherever the cluster has room (PACK: on as few nodes as
hold them). Each worker is a Ray actor in its bundle that starts the same `python -m
asyncllm.executor.worker_proc` the multiprocess executor starts, and waits for it:
Ray only places and supervises, and a worker exits when its actor ends (EOF on its
stdin), as a local one does when the core ends.

Between machines: rank 0 binds one CURVE-secured ZMQ socket (executor/hub.py) to the
core's address, ASYNCLLM_HOST_IP where set, else its node's IP as Ray reports it
(never all interfaces); the workers rendezvous through it (a `dist.Store`) and send
their status bytes and heartbeats over it. gloo's (and NCCL's bootstrap) sockets
bind to the interface holding that address on rank 0's node, and to the one that
reaches it on the others; that traffic itself is not authenticated (README).

Failure: one watchdog thread serves the hub, reads the workers' status (an error, or
no heartbeat for HANG_S: the worker's actor is killed) and watches the actors'
`run` calls (`ray.wait`), so a killed actor or a lost node is seen at once. The step
that meets the failure raises an error naming the rank, which fails the engine core
like any runner error: every request gets EngineDeadError. Shutdown kills the
actors and removes the placement group; if the core dies, Ray removes both with it
(it owns them).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
import uuid
from typing import Any

from asyncllm.config import EngineConfig
from asyncllm.errors import EngineStartupError
from asyncllm.executor.abstract import HANG_S, STOP_WAIT_S, TPExecutor
from asyncllm.executor.distributed import close_group, host_address, interface_of
from asyncllm.executor.hub import Hub, LocalStore
from asyncllm.executor.ray_actor import WorkerSupervisor, visible_devices
from asyncllm.executor.worker_proc import status_error
from asyncllm.ray_import import import_ray

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # the cluster has no room for the group: a start-up error
NAMESPACE = "asyncllm"  # the workers' actors: asyncllm-tp-<id>-rank<r> in this namespace
_STARTUP_POLL_MS = 10  # the store answers rendezvous requests this promptly
_POLL_MS = 100  # afterwards: a dead actor or an error is seen within this


@dataclasses.dataclass
class _RayWorker:
    rank: int
    actor: Any
    run: Any  # the ObjectRef of `actor.run`: ready when the worker or its actor ends
    ready: bool = False
    ended: bool = False  # its end (or failure) has been recorded
    last_seen: float = 0.0


class RayExecutor(TPExecutor):
    """Ranks 1..N-1 as Ray actors' worker processes, reached through rank 0's hub."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        ray = sys.modules.get("ray")
        # Joined (or, with no cluster to find, started) here: left at shutdown. The
        # core ends with os._exit, past Ray's own atexit clean-up, and a local
        # instance's agents would outlive it.
        self._owns_ray = ray is None or not ray.is_initialized()
        self._ray = import_ray("distributed_executor_backend")
        self.address = host_address(lambda: str(self._ray.util.get_node_ip_address()))
        self.name = f"asyncllm-tp-{uuid.uuid4().hex[:12]}"
        self.workers: list[_RayWorker] = []
        self.hub: Hub | None = None
        self.placement_group: Any = None
        self._cond = threading.Condition()  # ready flags and the start-up error
        self._startup_error: str | None = None
        self._joined = False
        self._thread: threading.Thread | None = None

    # -- start-up --------------------------------------------------------------------

    def start(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        hub = self.hub = Hub(self.address, self.size, self._on_status)
        pg = self.placement_group = self._place()
        if self.config.device == "cuda":
            self._use_bundle0_gpu(pg)
        config_json = self.config.to_json()
        keys = hub.keys.client.to_text()
        actor_cls = self._ray.remote(WorkerSupervisor)
        cuda = self.config.device == "cuda"
        for rank in range(1, self.size):
            actor = actor_cls.options(
                name=f"{self.name}-rank{rank}",
                namespace=NAMESPACE,
                max_concurrency=2,  # `pid` answers while `run` waits
                num_cpus=0 if cuda else self._cpus(),
                num_gpus=1 if cuda else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank
                ),
            ).remote()
            argv = ["--config", config_json, "--rank", str(rank), "--size", str(self.size)]
            run = actor.run.remote([*argv, "--hub", hub.endpoint], keys)
            self.workers.append(_RayWorker(rank, actor, run))
        self._thread = threading.Thread(target=self._watch, name="tp-ray-watchdog", daemon=True)
        self._thread.start()

    def _cpus(self) -> int:
        return self.config.num_threads or 1

    def _place(self) -> Any:
        """The placement group, created and ready; EngineStartupError naming what
        it asks for when the cluster has no room for it in PLACEMENT_TIMEOUT_S."""
        from ray.util.placement_group import placement_group, remove_placement_group

        ray = self._ray
        bundle = {"GPU": 1.0} if self.config.device == "cuda" else {"CPU": float(self._cpus())}
        node = ray.get_runtime_context().get_node_id()
        selectors = [{"ray.io/node-id": node}] + [{} for _ in range(1, self.size)]
        pg = placement_group(
            [dict(bundle) for _ in range(self.size)],
            strategy="PACK",
            name=self.name,
            bundle_label_selector=selectors,
        )
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(pg)
            raise EngineStartupError(
                f"tensor_parallel_size={self.size} over Ray: the cluster had no room within "
                f"{PLACEMENT_TIMEOUT_S:.0f}s for one bundle of {bundle} per rank (rank 0's "
                "on the engine core's node); `ray status` shows what is free"
            )
        return pg

    def _use_bundle0_gpu(self, pg: Any) -> None:
        """Rank 0 (this process) runs on the GPU Ray reserved in bundle 0, so that
        no worker Ray places on this node is given the same one."""
        import torch
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        probe = self._ray.remote(num_cpus=0, num_gpus=1)(visible_devices).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0
            )
        )
        physical = str(self._ray.get(probe.remote(), timeout=120)).split(",")[0]
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if not visible:
            torch.cuda.set_device(int(physical))
        elif physical in visible.split(","):
            torch.cuda.set_device(visible.split(",").index(physical))
        else:
            raise EngineStartupError(
                f"Ray reserved GPU {physical} for tensor-parallel rank 0, which this "
                f"process cannot see (CUDA_VISIBLE_DEVICES={visible})"
            )

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(w.ready for w in self.workers):
                if self._startup_error is not None:
                    raise EngineStartupError(self._startup_error)
                left = deadline - time.monotonic()
                if left <= 0:
                    waiting = [w.rank for w in self.workers if not w.ready]
                    raise EngineStartupError(
                        f"tensor-parallel rank(s) {waiting} were not ready within {timeout:.0f}s"
                    )
                self._cond.wait(min(left, 1.0))

    def rendezvous(self) -> tuple[Any, str]:
        assert self.hub is not None
        # a worker lost between its b"R" and the join fails the join at once
        return LocalStore(self.hub.table, lambda: self._startup_error), interface_of(self.address)

    def start_watchdog(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            w.last_seen = now
        self._joined = True  # from now on: heartbeats are watched

    # -- the watchdog (one thread: the hub's socket, the actors, the heartbeats) -----

    def _watch(self) -> None:
        assert self.hub is not None
        try:
            while not self._closing:
                self.hub.poll(_POLL_MS if self._joined else _STARTUP_POLL_MS)
                self._check_actors()
                if self._joined:
                    self._check_heartbeats()
        except Exception as exc:  # the watchdog itself failed: nothing is watched now
            if not self._closing:
                logger.exception("tensor-parallel watchdog failed")
                self._ended(None, f"the Ray executor's watchdog failed: {exc!r}")

    def _on_status(self, rank: int, data: bytes) -> None:
        w = self.workers[rank - 1]
        w.last_seen = time.monotonic()
        if data == b"R":
            with self._cond:
                w.ready = True
                self._cond.notify_all()
        elif data[:1] == b"E":
            self._ended(w, status_error(data) or "an error without text")

    def _check_actors(self) -> None:
        ray = self._ray
        runs = [w.run for w in self.workers if not w.ended]
        if not runs:
            return
        done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
        if not done:
            return
        assert self.hub is not None
        self.hub.poll(0)  # an error the worker sent before it exited comes first
        ended = set(done)
        for w in self.workers:
            if not w.ended and w.run in ended:
                self._ended(w, self._exit_text(w))

    def _exit_text(self, w: _RayWorker) -> str:
        ray = self._ray
        try:
            code = int(ray.get(w.run, timeout=1.0))
        except ray.exceptions.RayActorError as exc:
            return f"its Ray actor died ({type(exc).__name__})"
        except Exception as exc:
            return f"its Ray actor failed: {type(exc).__name__}: {exc}"
        if code < 0:
            return f"was killed by signal {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _check_heartbeats(self) -> None:
        now = time.monotonic()
        for w in self.workers:
            if not w.ended and now - w.last_seen > HANG_S:
                # the worker's end closes its sockets: the step waiting on it fails
                self._ray.wait([w.actor.kill_worker.remote()], timeout=1.0)
                self._ray.kill(w.actor, no_restart=True)
                silent = now - w.last_seen
                self._ended(w, f"no heartbeat for {silent:.1f}s, killed", hung=True)

    def _ended(self, w: _RayWorker | None, reason: str, hung: bool = False) -> None:
        """Record the first failure: a start-up error before the join, the
        executor's `failure` after it."""
        if w is not None:
            if w.ended:
                return
            w.ended = True
            who = f"tensor-parallel rank {w.rank} (Ray actor {self.name}-rank{w.rank})"
        else:
            who = "tensor parallelism"
        if not self._joined:
            with self._cond:
                if self._startup_error is None:
                    self._startup_error = f"{who} failed to start: {reason}"
                self._cond.notify_all()
            return
        self._fail(f"{who} {'hung' if hung else 'failed'}: {reason}")

    # -- shutdown --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop the workers (STOP if healthy), kill their actors, remove the
        placement group, close the hub. Idempotent."""
        if self._closing:
            return
        self._closing = True
        ray = self._ray
        runs = [w.run for w in self.workers]
        if self._send_stop() and runs:
            ray.wait(runs, num_returns=len(runs), timeout=STOP_WAIT_S)
        for w in self.workers:
            try:
                ray.kill(w.actor, no_restart=True)
            except Exception as exc:  # already gone
                logger.debug("killing the actor of rank %d: %s", w.rank, exc)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
            self.placement_group = None
        if self.hub is not None and (self._thread is None or not self._thread.is_alive()):
            self.hub.close()
        close_group()
        if self._owns_ray:
            ray.shutdown()
