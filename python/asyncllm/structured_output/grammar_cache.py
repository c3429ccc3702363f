"""Compiled output constraints, cached by (kind, spec): a leaf module that the
front end (to reject a bad schema, regex or grammar before it reaches the core)
and the engine core (to compile once per request, off the busy loop) both use.

The compiler (llguidance, in the Rust extension) walks the whole vocabulary when
it is built, so it is built on the first constrained request, not at start-up;
compiling then runs on the extension's own threads at the lowest scheduling
priority, with the GIL released and a deadline per grammar, so that a costly
grammar delays its own request, not the engine's steps nor other clients.

The cache is bounded twice: by entries and by the heap its grammars hold (each
grammar's size is measured as it compiles); least recently used grammars leave
first, and the extension hands their pages back to the system.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asyncllm import _core, envs
from asyncllm.errors import InvalidRequestError
from asyncllm.structured_output.params import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first): a service usually
# sends a handful of schemas over and over. Most grammars hold well under 1 MiB;
# one may hold up to the extension's per-grammar bound (32 MiB), so the byte bound
# is what keeps a client that sends distinct costly grammars from growing the
# process.
MAX_CACHED_GRAMMARS = 512
MAX_CACHED_GRAMMAR_BYTES = 128 << 20

# How long a request waits for its grammar to compile
# (ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S, default 10 s). The compile budget
# (llguidance's fuel) bounds the work to well under a second on an idle core;
# this bounds the wait when the compile threads, at the lowest priority, get
# little CPU. Past it the request fails (400); nothing else waits on it.
COMPILE_DEADLINE_S = envs.grammar_compile_deadline_s()

# Threads compiling for `compile_async` (the server): a slow schema holds one of
# these, never the event loop nor the threads that tokenize other requests.
COMPILE_THREADS = 2


class GrammarCache:
    """Thread-safe: the core's input thread compiles while the runner reads."""

    def __init__(
        self,
        tokenizer_json: str | Path,
        eos_token_ids: list[int],
        vocab_size: int,
        max_entries: int = MAX_CACHED_GRAMMARS,
        max_bytes: int = MAX_CACHED_GRAMMAR_BYTES,
    ):
        self.tokenizer_json = str(tokenizer_json)
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._compiler: _core.GrammarCompiler | None = None
        self._grammars: OrderedDict[tuple[str, str], _core.Grammar] = OrderedDict()
        self._num_bytes = 0  # sum of the cached grammars' size_bytes
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None

    @property
    def compiler(self) -> _core.GrammarCompiler:
        """The compiler, built on first use (raises InvalidRequestError if the
        tokenizer cannot carry constraints, e.g. without an EOS token)."""
        if self._compiler is None:
            with self._lock:
                if self._compiler is None:
                    try:
                        self._compiler = _core.GrammarCompiler(
                            self.tokenizer_json, self.eos_token_ids, self.vocab_size
                        )
                    except ValueError as e:
                        raise InvalidRequestError(
                            f"structured outputs are not available for this model: {e}"
                        ) from None
        return self._compiler

    def _cached(self, key: tuple[str, str]) -> _core.Grammar | None:
        """The grammar compiled for `key` before, now the most recently used."""
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
            return grammar

    def compile(self, params: StructuredOutputsParams) -> _core.Grammar:
        """The compiled grammar of `params`; raises InvalidRequestError naming
        what is wrong with it."""
        key = (params.kind, params.spec())
        grammar = self._cached(key)
        if grammar is not None:
            return grammar
        compiler = self.compiler
        try:
            # on the extension's low-priority threads; the GIL is released meanwhile
            grammar = compiler.compile(*key, timeout_s=COMPILE_DEADLINE_S)
        except ValueError as e:
            raise InvalidRequestError(f"structured_outputs: {e}") from None
        self._insert(key, grammar)
        return grammar

    def _insert(self, key: tuple[str, str], grammar: _core.Grammar) -> None:
        """Caches `grammar`, then drops the least recently used grammars until
        both bounds hold (the newest stays even if it alone is over the bytes)."""
        with self._lock:
            old = self._grammars.pop(key, None)  # compiled twice at once: keep one
            if old is not None:
                self._num_bytes -= old.size_bytes
            self._grammars[key] = grammar
            self._num_bytes += grammar.size_bytes
            while len(self._grammars) > 1 and (
                len(self._grammars) > self.max_entries or self._num_bytes > self.max_bytes
            ):
                _, evicted = self._grammars.popitem(last=False)
                self._num_bytes -= evicted.size_bytes

    @property
    def num_bytes(self) -> int:
        """Heap bytes the cached grammars hold."""
        return self._num_bytes

    @property
    def num_entries(self) -> int:
        return len(self._grammars)

    async def compile_async(self, params: StructuredOutputsParams) -> _core.Grammar:
        """`compile` for an event loop: a cached grammar at once, else compiled
        (and the compiler built, on first use) on this cache's own threads, so
        that one slow schema cannot stall the loop and every other client."""
        grammar = self._cached((params.kind, params.spec()))
        if grammar is not None:
            return grammar
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(
                    COMPILE_THREADS, thread_name_prefix="grammar-compile"
                )
            executor = self._executor
        return await asyncio.get_running_loop().run_in_executor(executor, self.compile, params)
