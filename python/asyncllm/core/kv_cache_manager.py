"""Maps requests to KV-cache blocks: allocation, prefix-cache lookups, freeing."""

from __future__ import annotations

from asyncllm.core.block_pool import DROPPED, BlockPool, KVBlock
from asyncllm.core.request import Request


class KVCacheManager:
    """Every request owns a list of blocks (its block table); blocks may be shared
    with other requests through the prefix cache.

    With `sliding_window` (every layer of the model attends to at most that many
    positions back), blocks that have left the window of a request's next query
    are given back to the pool as the request grows: its table keeps their place
    as `DROPPED` and the blocks no longer count against it, so a long request holds
    about window / block_size + 1 blocks. Prefix-cache hits out of the window are
    not taken at all, and when a prompt chunk does not fit, `fit_tokens` says how
    much of it does (the scheduler runs that much: the chunk after it finds the
    blocks before it given back), so a prompt far longer than the pool runs too."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        sliding_window: int | None = None,
        uncached_prompts_over: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        # Prompts longer than this neither hit nor fill the prefix cache: their K/V
        # differ from a shorter prompt's at the same tokens (Phi-3's longrope).
        self.uncached_prompts_over = uncached_prompts_over
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[int, list[KVBlock]] = {}
        self._num_cached_blocks: dict[int, int] = {}
        self._num_dropped: dict[int, int] = {}  # leading table entries given back
        self.prefix_cache_queries = 0  # prompt tokens looked up
        self.prefix_cache_hits = 0  # prompt tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks that starts the request's tokens,
        and the number of tokens they cover. Called once, before a request's first
        allocation. At least one token is always left to compute, since the model
        must produce logits for the last one. A request that wants prompt logprobs
        (even 0 of them: the prompt tokens' own) computes its whole prompt, and so
        does a mean-pooled embedding request (it adds up every token's hidden
        state; a cached block has none)."""
        limit = self.uncached_prompts_over
        if limit is not None and request.num_prompt_tokens > limit:
            request.block_hashes = None  # and so never registered either
        hashes = request.block_hashes
        if (
            not self.enable_caching
            or hashes is None
            or request.sampling_params.prompt_logprobs is not None
            or request.pooling == "mean"
        ):
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        get = self.pool.get_cached_block
        blocks = []
        for key in hashes[:max_blocks]:
            block = get(key)
            if block is None:
                break
            blocks.append(block)
        num_tokens = len(blocks) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_tokens
        return blocks, num_tokens

    def allocate(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> list[KVBlock] | None:
        """Give the request room for `num_new_tokens` more tokens after its computed
        ones (and after the prefix-cache blocks `computed`, which it now shares).
        Returns the blocks appended to its table, or None when the pool is too
        small (nothing is changed then, but for blocks that left the window)."""
        rid = request.request_id
        skip = 0  # leading `computed` blocks out of the window: not taken
        if self.sliding_window is not None:
            if rid in self.req_to_blocks:
                self._drop_out_of_window(rid, request.num_computed_tokens)
            elif computed:
                skip = self._first_in_window(len(computed) * self.block_size)
        needed = self._num_blocks_needed(request, num_new_tokens, computed)
        if needed > self._num_available(computed, skip):
            return None
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            blocks = self.req_to_blocks[rid] = []
            self._num_cached_blocks[rid] = 0
            self._num_dropped[rid] = skip
        added: list[KVBlock] = []
        if computed:
            taken = computed[skip:]
            self.pool.touch(taken)
            blocks.extend([DROPPED] * skip)
            blocks.extend(taken)
            added.extend(taken)
            self._num_cached_blocks[rid] = len(blocks)
        if needed > 0:
            new = self.pool.get_new_blocks(needed)
            blocks.extend(new)
            added.extend(new)
        return added

    def fit_tokens(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None = None
    ) -> int:
        """Sliding window only: how many of `num_new_tokens` (after the request's
        computed tokens, or after `computed` for a request not yet admitted) the
        pool has room for now; 0 when not even one. Called when `allocate` refused
        the whole chunk: the request runs the part that fits, and gives back the
        blocks that part leaves behind the window before its next chunk."""
        assert self.sliding_window is not None
        rid = request.request_id
        table = self.req_to_blocks.get(rid)
        if table is not None:
            self._drop_out_of_window(rid, request.num_computed_tokens)
            room = len(table) + self._num_available(None, 0)
            return max(0, min(num_new_tokens, room * self.block_size - request.num_computed_tokens))
        have = len(computed) if computed else 0
        skip = self._first_in_window(have * self.block_size) if computed else 0
        room = self._num_available(computed, skip) * self.block_size
        return max(0, min(num_new_tokens, room))

    def allocate_decode_blocks(self, requests: list[Request]) -> dict[int, list[int]] | None:
        """One new block for each of `requests`, running decodes whose computed
        tokens exactly fill their blocks (the next token starts a new one). Returns
        request id -> [new block id], or None when the pool is too small (nothing
        is changed then). The all-decode fast path of `Scheduler.schedule`."""
        if self.sliding_window is not None:
            for request in requests:
                self._drop_out_of_window(request.request_id, request.num_computed_tokens)
        if len(requests) > self.pool.num_free_blocks:
            return None
        new = self.pool.get_new_blocks(len(requests))
        req_to_blocks = self.req_to_blocks
        out = {}
        for request, block in zip(requests, new, strict=True):
            rid = request.request_id
            req_to_blocks[rid].append(block)
            out[rid] = [block.block_id]
        return out

    def cache_blocks(self, request: Request) -> None:
        """Register the request's blocks that its computed tokens now fill, so
        later requests can share them. Called after each step that computed tokens."""
        hashes = request.block_hashes
        if not self.enable_caching or hashes is None:
            return
        rid = request.request_id
        num_full = min(request.num_computed_tokens // self.block_size, len(hashes))
        done = self._num_cached_blocks[rid]
        if num_full > done:
            self.pool.cache_full_blocks(self.req_to_blocks[rid], hashes, done, num_full)
            self._num_cached_blocks[rid] = num_full

    def free(self, request: Request) -> None:
        """Return all the request's blocks. The tail goes first on the free list, so
        a shared prefix outlives the suffixes that hang off it."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        dropped = self._num_dropped.pop(request.request_id, 0)
        if blocks:
            self.pool.free_blocks(reversed(blocks[dropped:]))

    def block_ids(self, request_id: int) -> list[int]:
        """The request's block table; a dropped entry (out of every layer's window,
        never read again) reads as block 0, a valid id that no kernel reads."""
        return [max(b.block_id, 0) for b in self.req_to_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: int) -> int:
        """Blocks the request holds now (its table minus the dropped entries)."""
        return len(self.req_to_blocks.get(request_id, ())) - self._num_dropped.get(request_id, 0)

    def _first_in_window(self, first_query: int) -> int:
        """The first block a query at `first_query` (and every later one) may read:
        the blocks before it hold only positions <= first_query - window."""
        assert self.sliding_window is not None
        return max(0, first_query - self.sliding_window + 1) // self.block_size

    def _drop_out_of_window(self, request_id: int, first_query: int) -> None:
        """Give back the request's blocks whose every position is out of the window
        of a query at `first_query` and after: positions <= first_query - window."""
        limit = self._first_in_window(first_query)
        start = self._num_dropped[request_id]
        if limit <= start:
            return
        blocks = self.req_to_blocks[request_id]
        limit = min(limit, len(blocks))
        self.pool.free_blocks(blocks[start:limit])
        for i in range(start, limit):
            blocks[i] = DROPPED
        self._num_dropped[request_id] = limit

    def _num_blocks_needed(
        self, request: Request, num_new_tokens: int, computed: list[KVBlock] | None
    ) -> int:
        num_computed = request.num_computed_tokens + (
            len(computed) * self.block_size if computed else 0
        )
        total = -(-(num_computed + num_new_tokens) // self.block_size)
        have = len(self.req_to_blocks.get(request.request_id, ())) + (
            len(computed) if computed else 0
        )
        return max(0, total - have)

    def _num_available(self, computed: list[KVBlock] | None, skip: int = 0) -> int:
        # Cached blocks we are about to share but that sit on the free list stop
        # being available once we take them (all but the `skip` we leave).
        free = self.pool.num_free_blocks
        if computed:
            free -= sum(1 for b in computed[skip:] if b.ref_cnt == 0)
        return free
