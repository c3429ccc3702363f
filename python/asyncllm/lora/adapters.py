"""The host's adapters: read, checked against the model, kept in an LRU of
`max_cpu_loras`.

`get` runs off the busy loop (the engine core calls it when a request arrives,
from `make_request`), so reading the files never stalls a step; the busy loop only
copies an adapter from here into a device slot (`lora.slots`). A request holds its
`LoadedAdapter` until it ends, so evicting or unloading an adapter here never
changes what a running request computes with.

Under tensor parallelism each rank holds its own slice of every adapter, cut as
its base layers are (`lora.targets`); rank 0's reads are announced to the other
ranks through `on_read` (`lora.ranks`).
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from asyncllm.errors import InvalidRequestError
from asyncllm.lora.layers import Pair, SlotContents, lay_out_slot
from asyncllm.lora.peft import read_adapter
from asyncllm.lora.request import LoRARequest
from asyncllm.lora.targets import LoRATarget

_SERIALS = itertools.count(1)


@dataclass(eq=False, slots=True, weakref_slot=True)
class LoadedAdapter:
    """An adapter ready for a slot: per target, its slot contents in the model's
    dtype, laid out as the slots hold them (`lora.layers.lay_out_slot`: a slot
    write is a copy), or None where it adapts none of the target's projections.
    Host memory per adapter is one slot's. Compared by identity: a reload is
    another adapter, with another `serial` (how the tensor-parallel ranks name it
    to each other: a reload of unchanged files has the same `cache_key`)."""

    request: LoRARequest
    rank: int
    contents: list[SlotContents | None]
    cache_key: str  # its prefix-cache identity (name, id, path and file identity)
    serial: int = field(default_factory=lambda: next(_SERIALS))


class HostAdapters:
    """Adapters by `lora_int_id`, least recently used first; thread-safe."""

    def __init__(
        self, targets: list[LoRATarget], capacity: int, max_rank: int, dtype: torch.dtype
    ) -> None:
        self.targets = targets
        self.capacity = capacity
        self.max_rank = max_rank
        self.dtype = dtype
        self._by_id: OrderedDict[int, LoadedAdapter] = OrderedDict()
        self._lock = threading.Lock()
        # called with each adapter `read` returns (rank 0 of tensor parallelism:
        # the other ranks read it too, lora.ranks.AdapterFeed)
        self.on_read: Callable[[LoadedAdapter], None] | None = None

    def get(self, request: LoRARequest) -> LoadedAdapter:
        """The adapter `request` names, read from its path unless held. Raises
        InvalidRequestError (bad files, rank, modules, shapes; or the id is held
        for another name or path)."""
        with self._lock:
            held = self._by_id.get(request.lora_int_id)
            if held is not None:
                if held.request != request:
                    raise InvalidRequestError(
                        f"LoRARequest.lora_int_id={request.lora_int_id} is loaded as "
                        f"{held.request.lora_name!r} from {held.request.lora_path!r}; unload "
                        "it first or use another id"
                    )
                self._by_id.move_to_end(request.lora_int_id)
                return held
        adapter = self.read(request)  # outside the lock: files may be slow
        with self._lock:
            self._by_id[request.lora_int_id] = adapter
            self._by_id.move_to_end(request.lora_int_id)
            while len(self._by_id) > self.capacity:
                self._by_id.popitem(last=False)
        return adapter

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (running requests keep theirs); whether it was held."""
        with self._lock:
            return self._by_id.pop(lora_int_id, None) is not None

    def names(self) -> list[str]:
        with self._lock:
            return [a.request.lora_name for a in self._by_id.values()]

    def read(self, request: LoRARequest) -> LoadedAdapter:
        """Read and check an adapter against the targets, laid out for the slots
        (not cached)."""
        tensors = read_adapter(request.lora_path, self.max_rank)
        modules = dict(tensors.modules)
        contents = [
            lay_out_slot(
                [self._take(modules, src, t, k) for k, src in enumerate(t.sources)],
                t.in_features,
                t.slices,
                self.max_rank,
                tensors.scale,
                self.dtype,
            )
            for t in self.targets
        ]
        if modules:
            known = sorted({s.rpartition(".")[2] for t in self.targets for s in t.sources})
            raise InvalidRequestError(
                f"LoRA adapter {request.lora_path!r}: module {sorted(modules)[0]!r} is not one "
                f"this model adapts (the targets are {', '.join(known)} of each layer)"
            )
        key = f"{request.cache_key}\0{tensors.identity}"
        adapter = LoadedAdapter(request, tensors.rank, contents, key)
        if self.on_read is not None:
            self.on_read(adapter)
        return adapter

    def _take(
        self, modules: dict[str, Pair], source: str, target: LoRATarget, k: int
    ) -> Pair | None:
        pair = modules.pop(source, None)
        if pair is None:
            return None
        a, b = pair
        # the unsharded layer's sizes (what the file must fit), then this rank's cut
        shard = None if target.shards is None else target.shards[k]
        inputs = shard.total if shard is not None and shard.dim == 1 else target.in_features
        outputs = shard.total if shard is not None and shard.dim == 0 else target.slices[k]
        if a.shape[1] != inputs or b.shape[0] != outputs:
            raise InvalidRequestError(
                f"LoRA module {source!r}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the layer ({inputs} inputs, {outputs} outputs)"
            )
        if shard is not None and shard.dim == 0:  # column-parallel: its outputs of B
            b = b[shard.start : shard.stop]
        elif shard is not None and shard.dim == 1:  # row-parallel: its inputs of A
            a = a[:, shard.start : shard.stop]
        return a, b
