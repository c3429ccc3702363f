"""The host's adapters: read, checked against the model, kept in an LRU of
`max_cpu_loras`.

`get` runs off the busy loop (the engine core calls it when a request arrives,
from `make_request`), so reading the files never stalls a step; the busy loop only
copies an adapter from here into a device slot (`lora.slots`). A request holds its
`LoadedAdapter` until it ends, so evicting or unloading an adapter here never
changes what a running request computes with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from asyncllm.errors import InvalidRequestError
from asyncllm.lora.layers import Pair, SlotContents, lay_out_slot
from asyncllm.lora.peft import read_adapter
from asyncllm.lora.request import LoRARequest
from asyncllm.lora.targets import LoRATarget


@dataclass(eq=False, slots=True)
class LoadedAdapter:
    """An adapter ready for a slot: per target, its slot contents in the model's
    dtype, laid out as the slots hold them (`lora.layers.lay_out_slot`: a slot
    write is a copy), or None where it adapts none of the target's projections.
    Host memory per adapter is one slot's. Compared by identity: a reload is
    another adapter."""

    request: LoRARequest
    rank: int
    contents: list[SlotContents | None]
    cache_key: str  # its prefix-cache identity (name, id, path and file identity)


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
        return LoadedAdapter(request, tensors.rank, contents, key)

    def _take(
        self, modules: dict[str, Pair], source: str, target: LoRATarget, k: int
    ) -> Pair | None:
        pair = modules.pop(source, None)
        if pair is None:
            return None
        a, b = pair
        if a.shape[1] != target.in_features or b.shape[0] != target.slices[k]:
            raise InvalidRequestError(
                f"LoRA module {source!r}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} do not fit the layer ({target.in_features} inputs, "
                f"{target.slices[k]} outputs)"
            )
        return a, b
