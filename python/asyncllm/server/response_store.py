"""The responses `/v1/responses` keeps (`store: true`, read back with `GET
/v1/responses/{id}`, continued with `previous_response_id`): in memory, off
unless the server runs with --enable-store, and bounded — at most
--max-stored-responses of them and --max-response-store-bytes together, the
least recently used going first.

Each is kept under the API key its request came with (a hash of it): a client
holding another key neither sees nor deletes it. A server without --api-key
still scopes by whatever key a client sends, so that clients sharing such a
server keep their conversations apart."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


def scope_of(headers: dict[bytes, bytes]) -> str:
    """The store's scope for a request: its API key (Bearer or x-api-key), hashed."""
    key = headers.get(b"authorization", b"").removeprefix(b"Bearer ")
    key = key or headers.get(b"x-api-key", b"")
    return hashlib.sha256(key).hexdigest()


@dataclass
class StoredResponse:
    """A response as GET answers it, and its conversation as chat messages (the
    input it was given, then its output) for a request that continues it."""

    body: dict[str, Any]
    conversation: list[dict[str, Any]]
    num_bytes: int


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._items: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def can_put(self, num_bytes: int) -> bool:
        """Whether one response of `num_bytes` fits at all (alone in the store)."""
        return num_bytes <= self.max_bytes

    def put(self, scope: str, response_id: str, stored: StoredResponse) -> None:
        """Keep `stored`, evicting the least recently used to stay in bounds; the
        caller has checked `can_put`."""
        key = (scope, response_id)
        old = self._items.pop(key, None)
        if old is not None:
            self.num_bytes -= old.num_bytes
        self._items[key] = stored
        self.num_bytes += stored.num_bytes
        while len(self._items) > self.max_count or self.num_bytes > self.max_bytes:
            _, evicted = self._items.popitem(last=False)
            self.num_bytes -= evicted.num_bytes

    def get(self, scope: str, response_id: str) -> StoredResponse | None:
        stored = self._items.get((scope, response_id))
        if stored is not None:
            self._items.move_to_end((scope, response_id))
        return stored

    def delete(self, scope: str, response_id: str) -> bool:
        stored = self._items.pop((scope, response_id), None)
        if stored is None:
            return False
        self.num_bytes -= stored.num_bytes
        return True
