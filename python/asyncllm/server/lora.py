"""The adapters a client may name in a request's `model`, and the endpoints that
change them at run time.

`--lora-modules name=path` serves adapters from the start; with
`--allow-runtime-lora-updating`, `POST /v1/load_lora_adapter` and
`/v1/unload_lora_adapter` (behind the API key like every route but /health) add
and remove them. Loading reads and checks the adapter in the engine core first,
so a name only becomes servable once its files passed; a bad adapter is a 400
naming what is wrong, and the server serves on.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from pydantic import BaseModel, Field
from starlette.requests import Request
from starlette.responses import Response

from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.lora.request import MAX_LORA_NAME_LEN, MAX_LORA_PATH_LEN, LoRARequest
from asyncllm.server.protocol import APIError, bad_request, parse_body

_LOAD_TIMEOUT_S = 60.0
MAX_SERVED_ADAPTERS = 4096


class LoadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LEN)
    lora_path: str = Field(min_length=1, max_length=MAX_LORA_PATH_LEN)


class UnloadLoRARequest(BaseModel):
    lora_name: str = Field(min_length=1, max_length=MAX_LORA_NAME_LEN)


def parse_lora_modules(specs: list[str] | None) -> list[tuple[str, str]]:
    """`name=path` items of --lora-modules; ConfigError names a malformed one."""
    modules = []
    for spec in specs or ():
        name, eq, path = spec.partition("=")
        if not eq or not name or not path:
            raise ConfigError(f"--lora-modules {spec!r}: expected name=path")
        modules.append((name, path))
    return modules


class ServedAdapters:
    """Adapter name -> its LoRARequest (ids handed out in order, never reused)."""

    def __init__(self, base_names: list[str]) -> None:
        self.base_names = base_names
        self.by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def new(self, name: str, path: str) -> LoRARequest:
        """A request for a name not served yet; InvalidRequestError otherwise."""
        if name in self.by_name or name in self.base_names:
            raise InvalidRequestError(f"lora_name {name!r} is already served")
        if len(self.by_name) >= MAX_SERVED_ADAPTERS:
            raise InvalidRequestError(f"already serving {MAX_SERVED_ADAPTERS} adapters")
        return LoRARequest(name, next(self._ids), path)

    def lookup(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model; 404 for neither."""
        if model is None or model in self.base_names:
            return None
        lora = self.by_name.get(model)
        if lora is None:
            names = [*self.base_names, *self.by_name]
            raise APIError(
                404,
                f"The model `{model[:200]}` does not exist; this server serves {', '.join(names)}",
                param="model",
                code="model_not_found",
            )
        return lora

    def models(self, max_model_len: int) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, each with its parent."""
        parent = self.base_names[0]
        return [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "asyncllm",
                "root": lora.lora_path,
                "parent": parent,
                "max_model_len": max_model_len,
            }
            for name, lora in self.by_name.items()
        ]


class LoRAHandlers:
    """/v1/load_lora_adapter and /v1/unload_lora_adapter."""

    def __init__(self, engine: AsyncLLM, adapters: ServedAdapters) -> None:
        self.engine = engine
        self.adapters = adapters
        self._lock = asyncio.Lock()

    async def add(self, name: str, path: str) -> LoRARequest:
        """Load into the core, then serve it; InvalidRequestError names a bad adapter."""
        async with self._lock:
            lora = self.adapters.new(name, path)
            args = {"lora_name": name, "lora_int_id": lora.lora_int_id, "lora_path": path}
            await self.engine.call_utility("add_lora", args, _LOAD_TIMEOUT_S)
            self.adapters.by_name[name] = lora
            return lora

    async def load(self, request: Request) -> Response:
        req = parse_body(LoadLoRARequest, await request.body())
        try:
            await self.add(req.lora_name, req.lora_path)
        except (InvalidRequestError, RuntimeError) as exc:
            raise bad_request(str(exc), "lora_path") from None
        return Response(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

    async def unload(self, request: Request) -> Response:
        req = parse_body(UnloadLoRARequest, await request.body())
        async with self._lock:
            lora = self.adapters.by_name.pop(req.lora_name, None)
            if lora is None:
                raise APIError(
                    404,
                    f"The lora adapter '{req.lora_name[:200]}' cannot be found.",
                    param="lora_name",
                )
            await self.engine.call_utility("remove_lora", lora.lora_int_id, _LOAD_TIMEOUT_S)
        return Response(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
