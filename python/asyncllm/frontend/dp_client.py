"""Data parallelism: N engine cores behind one front end.

Each core is a whole engine (its own scheduler, KV cache and model replica) in
its own process, reached through an `MPClient`. A new request (all n children of
one prompt together, so they share its prefix blocks) goes to the core with the
fewest unfinished requests; the front end counts them exactly (added here,
removed when a core reports them finished), which is the cores' running +
waiting without the lag of their stats. The request -> core map sends each abort
to its owner. Utility calls go to every core and return the list of results.

With `prefix_aware_routing`, a prompt whose first KV block (and cache salt) was
routed before goes to the same core, whose prefix cache may still hold it, as
long as that core has at most `_PREFIX_SLACK` more unfinished requests than the
least-loaded one; the map of first blocks is a bounded LRU.

Failure semantics: the engine is one service, so any core dying makes the whole
engine dead, as one core's death does without data parallelism: every waiting
request fails with `EngineDeadError`, `/health` answers 503, and the server exits
non-zero. The other cores are stopped at shutdown.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncllm import _core
from asyncllm.config import EngineArgs
from asyncllm.errors import EngineDeadError, EngineStartupError
from asyncllm.frontend.core_client import MPClient
from asyncllm.tracing import Tracer

logger = logging.getLogger(__name__)

_PREFIX_SLACK = 8  # extra requests a core may have and still get its prefixes' requests
_MAX_PREFIX_KEYS = 65536  # first blocks remembered for prefix-aware routing


def make_client(
    args: EngineArgs,
    on_output: Callable[[_core.OutputBatch], None],
    on_dead: Callable[[EngineDeadError], None],
    *,
    in_thread: bool = False,
    startup_timeout: float = 300.0,
    tracer: Tracer | None = None,
) -> MPClient | DPClient:
    """One core's client, or the data-parallel client of `args.data_parallel_size`."""
    if args.data_parallel_size == 1:
        return MPClient(
            args,
            on_output,
            on_dead,
            in_thread=in_thread,
            startup_timeout=startup_timeout,
            tracer=tracer,
        )
    if in_thread:
        raise EngineStartupError(
            "EngineArgs.data_parallel_size > 1 needs the engine cores in their own "
            "processes (multiprocess=True)"
        )
    return DPClient(args, on_output, on_dead, startup_timeout=startup_timeout, tracer=tracer)


def _threads_per_core(args: EngineArgs) -> int | None:
    """Each core's torch threads (each tensor-parallel rank's): what the user asked
    for, else the machine's CPUs shared out among all ranks of all cores, unless
    OMP_NUM_THREADS says how many (torch's default then)."""
    if args.num_threads is not None or os.environ.get("OMP_NUM_THREADS"):
        return args.num_threads
    ranks = args.data_parallel_size * args.tensor_parallel_size
    return max(1, (os.cpu_count() or 1) // ranks)


class DPClient:
    """`MPClient`'s interface over `args.data_parallel_size` engine cores."""

    def __init__(
        self,
        args: EngineArgs,
        on_output: Callable[[_core.OutputBatch], None],
        on_dead: Callable[[EngineDeadError], None],
        *,
        startup_timeout: float = 300.0,
        tracer: Tracer | None = None,
    ) -> None:
        size = args.data_parallel_size
        self._on_output = on_output
        self._on_dead_cb = on_dead
        self._lock = threading.Lock()  # owners and loads: the event loop adds, receivers remove
        self._owner: dict[int, int] = {}  # wire id -> core index
        self.loads = [0] * size  # unfinished requests per core
        self._block_size = args.block_size if args.prefix_aware_routing else 0
        self._prefix_owner: OrderedDict[tuple[Any, ...], int] = OrderedDict()
        self.dead: EngineDeadError | None = None
        self._closing = False
        one = dataclasses.replace(args, data_parallel_size=1, num_threads=_threads_per_core(args))

        def start(rank: int) -> MPClient:
            try:
                return MPClient(
                    one,
                    lambda batch: self._on_batch(rank, batch),
                    self._on_dead,
                    startup_timeout=startup_timeout,
                    tracer=tracer,
                )
            except EngineStartupError as exc:
                raise EngineStartupError(f"data-parallel rank {rank}: {exc}") from exc

        # start every core at once: each loads its own copy of the model
        with ThreadPoolExecutor(max_workers=size, thread_name_prefix="dp-start") as pool:
            futures = [pool.submit(start, rank) for rank in range(size)]
        clients = [f.result() for f in futures if f.exception() is None]
        failed = [f.exception() for f in futures if f.exception() is not None]
        if failed:
            for client in clients:
                client.shutdown()
            raise failed[0]  # type: ignore[misc]
        self.clients = clients
        self.ready = clients[0].ready

    # -- requests -------------------------------------------------------------------

    def add_requests(self, requests: Sequence[_core.AddRequest]) -> None:
        """Send one prompt's requests (its n children) to the least-loaded core."""
        if not requests:
            return
        key = self._prefix_key(requests[0])
        with self._lock:
            rank = min(range(len(self.loads)), key=self.loads.__getitem__)
            if key is not None:
                cached = self._prefix_owner.get(key)
                if cached is not None and self.loads[cached] <= self.loads[rank] + _PREFIX_SLACK:
                    rank = cached
                self._prefix_owner[key] = rank
                self._prefix_owner.move_to_end(key)
                if len(self._prefix_owner) > _MAX_PREFIX_KEYS:
                    self._prefix_owner.popitem(last=False)
            self.loads[rank] += len(requests)
            for r in requests:
                self._owner[r.wire_id] = rank
        self.clients[rank].add_requests(requests)

    def add_request_groups(self, groups: Sequence[Sequence[_core.AddRequest]]) -> None:
        """Each prompt's requests to its own core, as `add_requests` routes them."""
        for g in groups:
            self.add_requests(g)

    def _prefix_key(self, request: _core.AddRequest) -> tuple[Any, ...] | None:
        """The routing key of a prompt's first full KV block, if prefix-aware."""
        bs = self._block_size
        if not bs or request.num_prompt_tokens < bs:
            return None
        return (request.cache_salt, *request.prompt_token_ids[:bs])

    def abort_requests(self, wire_ids: Sequence[int]) -> None:
        by_rank: dict[int, list[int]] = {}
        with self._lock:
            for wire_id in wire_ids:
                rank = self._owner.get(wire_id)
                if rank is not None:
                    by_rank.setdefault(rank, []).append(wire_id)
        for rank, ids in by_rank.items():
            self.clients[rank].abort_requests(ids)

    def owner_of(self, wire_id: int) -> int | None:
        """The core that runs a request (None once it finished)."""
        return self._owner.get(wire_id)

    def _on_batch(self, rank: int, batch: _core.OutputBatch) -> None:
        """A core's receiver thread: forget the requests that finished there."""
        finished = batch.finished_indices
        if finished:
            wire_ids = batch.wire_ids
            with self._lock:
                for i in finished:
                    if self._owner.pop(wire_ids[i], None) is not None:
                        self.loads[rank] -= 1
        self._on_output(batch)

    def call_utility(self, method: str, args: Any = None) -> Future[Any]:
        """Run `method` on every core; the future holds the list of their results."""
        futures = [c.call_utility(method, args) for c in self.clients]
        combined: Future[Any] = Future()
        remaining = [len(futures)]
        lock = threading.Lock()

        def done(_: Future[Any]) -> None:
            with lock:
                remaining[0] -= 1
                if remaining[0] or combined.done():
                    return
            try:
                combined.set_result([f.result() for f in futures])
            except BaseException as exc:  # one core's failure is the call's
                combined.set_exception(exc)

        for f in futures:
            f.add_done_callback(done)
        return combined

    def send_raw(self, frame: bytes) -> None:
        """Send a frame as is to the first core (for robustness tests)."""
        self.clients[0].send_raw(frame)

    @property
    def num_pending_calls(self) -> int:
        return sum(c.num_pending_calls for c in self.clients)

    @property
    def num_backlogged(self) -> int:
        return sum(c.num_backlogged for c in self.clients)

    @property
    def process(self) -> Any:
        """The first core's process (as `MPClient.process`)."""
        return self.clients[0].process

    # -- lifecycle ------------------------------------------------------------------

    def _on_dead(self, error: EngineDeadError) -> None:
        with self._lock:
            if self.dead is not None:
                return
            self.dead = error
        if not self._closing:
            logger.error("a data-parallel engine core died: %s", error)
        self._on_dead_cb(error)

    @property
    def is_alive(self) -> bool:
        return self.dead is None and not self._closing and all(c.is_alive for c in self.clients)

    def shutdown(self) -> None:
        """Stop every core. Idempotent; never raises."""
        self._closing = True
        for client in getattr(self, "clients", []):
            client.shutdown()


_SUMMED = (
    "num_running",
    "num_waiting",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def merge_stats(per_core: list[dict[str, Any]]) -> dict[str, Any]:
    """The cores' `get_stats` as one: counts summed, KV-cache usage averaged (the
    cores have equal pools), and each core's own under "engines" (for /metrics)."""
    merged: dict[str, Any] = {"engines": per_core}
    for key in _SUMMED:
        if all(key in s for s in per_core):
            merged[key] = sum(s[key] for s in per_core)
    if all("kv_cache_usage" in s for s in per_core):
        merged["kv_cache_usage"] = sum(s["kv_cache_usage"] for s in per_core) / len(per_core)
    return merged
