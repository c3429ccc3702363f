"""Adapters on every tensor-parallel rank: rank 0 decides, the other ranks follow.

Rank 0 alone has requests, the host LRU and the choice of slots. Each step's
message to the workers (executor/step_channel.py) carries the step's token→slot
map and, as int64 events, what changed on rank 0 since the last message:

    LOAD   [1, serial, lora_int_id, m, n, w_1 .. w_k]   rank 0 read adapter `serial`
           (n UTF-8 bytes: the name's m, then path \\0 file identity; k = ceil(n / 8))
    DROP   [2, serial]          rank 0 holds it no more (not cached, in no request,
                                in no slot: its last reference went)
    WRITE  [3, slot, serial]    rank 0 copied it into `slot`

A worker reads an announced adapter itself, its own slice from the same files
(`lora.targets`), on a background thread: as on rank 0, the read is off the step
path unless a request needs the adapter in the very step it was read for. It keeps
it until DROP, so whatever rank 0 can still write into a slot (a request that
arrived before an unload) the worker holds too. A WRITE waits for the read. The
worker's read must find the files rank 0 read (same path, size and mtime): files
replaced between the two reads fail the step rather than mix two adapters' weights.
"""

from __future__ import annotations

import collections
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asyncllm.lora.adapters import LoadedAdapter
from asyncllm.lora.model import LoRAModel
from asyncllm.lora.request import LoRARequest

LOAD, DROP, WRITE = 1, 2, 3
NO_EVENTS = np.empty(0, dtype=np.int64)


class AdapterFeed:
    """Rank 0's side: records reads, drops and slot writes as they happen (reads on
    the threads that make requests, drops wherever the last reference goes, writes
    on the busy loop) and hands them over once per step message (`take`)."""

    def __init__(self, lora: LoRAModel) -> None:
        # a deque: appends and pops are atomic, and a drop may run inside `take`
        # (a garbage collection on the busy loop), so no lock could be taken there
        self._events: collections.deque[np.ndarray] = collections.deque()
        lora.host.on_read = self.loaded
        lora.slots.on_write = self.written

    def loaded(self, adapter: LoadedAdapter) -> None:
        request = adapter.request
        identity = adapter.cache_key.removeprefix(request.cache_key + "\0")
        name = request.lora_name.encode()
        data = name + f"{request.lora_path}\0{identity}".encode()
        words = np.zeros(-(-len(data) // 8), dtype=np.int64)
        words.view(np.uint8)[: len(data)] = np.frombuffer(data, dtype=np.uint8)
        fields = [LOAD, adapter.serial, request.lora_int_id, len(name), len(data)]
        head = np.array(fields, dtype=np.int64)
        self._events.append(np.concatenate((head, words)))
        drop = np.array([DROP, adapter.serial], dtype=np.int64)
        weakref.finalize(adapter, self._events.append, drop).atexit = False

    def written(self, slot: int, adapter: LoadedAdapter) -> None:
        self._events.append(np.array([WRITE, slot, adapter.serial], dtype=np.int64))

    def take(self) -> np.ndarray:
        """Every event since the last call, in order (empty: none)."""
        events = []
        while self._events:
            events.append(self._events.popleft())
        return np.concatenate(events) if events else NO_EVENTS


class AdapterMirror:
    """A worker's side: applies rank 0's events to its own `LoRAModel` (`apply`,
    before the step's forward). `same_files`: the worker sees rank 0's very files
    (one machine), so their identity (real path, size, mtime) must match exactly;
    across machines only the size is compared."""

    def __init__(self, lora: LoRAModel, same_files: bool) -> None:
        self.lora = lora
        self.same_files = same_files
        self._reads: dict[int, Future[LoadedAdapter]] = {}
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-read")

    def apply(self, events: np.ndarray) -> None:
        """Apply `events` (`AdapterFeed.take` on rank 0). Raises RuntimeError when
        a read failed or found other files than rank 0's."""
        i = 0
        while i < len(events):
            kind = int(events[i])
            if kind == LOAD:
                serial, lora_id, m, n = (int(v) for v in events[i + 1 : i + 5])
                k = -(-n // 8)
                data = events[i + 5 : i + 5 + k].view(np.uint8)[:n].tobytes()
                path, identity = data[m:].decode().split("\0", 1)
                request = LoRARequest(data[:m].decode(), lora_id, path)
                self._reads[serial] = self._pool.submit(self._read, request, identity)
                i += 5 + k
            elif kind == DROP:
                self._reads.pop(int(events[i + 1]), None)
                i += 2
            elif kind == WRITE:
                slot, serial = int(events[i + 1]), int(events[i + 2])
                read = self._reads.get(serial)
                if read is None:
                    raise RuntimeError(f"LoRA adapter #{serial} written to slot {slot} unread")
                self.lora.slots.write(slot, read.result())
                i += 3
            else:
                raise RuntimeError(f"unknown LoRA event kind {kind} from rank 0")

    def held(self) -> list[int]:
        """The serials of the adapters this rank holds (read or being read)."""
        return list(self._reads)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _read(self, request: LoRARequest, identity: str) -> LoadedAdapter:
        adapter = self.lora.host.read(request)
        mine = adapter.cache_key.removeprefix(request.cache_key + "\0")
        if self.same_files:
            same = mine == identity
        else:  # identities are (real path, size, mtime): only the size travels
            same = mine.split("\0")[1] == identity.split("\0")[1]
        if not same:
            raise RuntimeError(
                f"LoRA adapter {request.lora_name!r}: the files at {request.lora_path!r} "
                "changed between rank 0's read and this rank's; load it again"
            )
        return adapter
