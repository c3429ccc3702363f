"""The pool of KV-cache blocks: free list, reference counts and the prefix cache.

A block whose reference count drops to zero goes back on the free list but keeps
its hash, so a later request with the same prefix can take it back (a cache hit)
until the block is handed out again; the free list is ordered so the least
recently used block is handed out first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from asyncllm.core.request import BlockHash


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None

    def __repr__(self) -> str:
        cached = self.block_hash is not None
        return f"KVBlock({self.block_id}, ref_cnt={self.ref_cnt}, cached={cached})"


# A request's table entry whose block it gave back (sliding window: no layer reads
# it again); not in the pool, never freed or cached.
DROPPED = KVBlock(-1)


class BlockPool:
    """Owns every block. Invariant: a block is on the free list iff its ref_cnt is 0."""

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Insertion order is eviction order: the first entry is handed out first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live requests."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` blocks off the free list (evicting their cached
        contents). The caller must have checked `num_free_blocks`."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = self.blocks
        free = self._free
        out = []
        for _ in range(num_blocks):
            block = blocks[free.popitem(last=False)[0]]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks a request is about to share."""
        free = self._free
        for block in blocks:
            if block.ref_cnt == 0:
                del free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop a reference on each block, in the order given: blocks freed first
        are evicted first."""
        free = self._free
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                free[block.block_id] = None

    def cache_full_blocks(
        self, blocks: Sequence[KVBlock], block_hashes: Sequence[BlockHash], start: int, end: int
    ) -> None:
        """Register blocks[start:end], whose K/V are now computed, under their hashes."""
        cached = self._cached
        for i in range(start, end):
            block = blocks[i]
            if block.block_hash is not None or block is DROPPED:
                continue  # already cached (a shared prefix block), or given back
            key = block_hashes[i]
            block.block_hash = key
            cached.setdefault(key, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Refused (False) while any block is in use,
        since live requests may still match their own cached blocks."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        key = block.block_hash
        assert key is not None
        if self._cached.get(key) is block:
            del self._cached[key]
        block.block_hash = None
