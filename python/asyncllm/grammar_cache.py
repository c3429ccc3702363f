"""Compiled output constraints, cached by (kind, spec): a leaf module that the
front end (to reject a bad schema, regex or grammar before it reaches the core)
and the engine core (to compile once per request, off the busy loop) both use.

The compiler (llguidance, in the Rust extension) walks the whole vocabulary when
it is built, so it is built on the first constrained request, not at start-up;
compiling then runs with the GIL released.
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from asyncllm import _core
from asyncllm.errors import InvalidRequestError
from asyncllm.structured_outputs import StructuredOutputsParams

# Compiled grammars kept (least recently used dropped first); each is small next
# to a model, and a service usually sends a handful of schemas over and over.
MAX_CACHED_GRAMMARS = 512

# Threads compiling for `compile_async` (the server): a slow schema holds one of
# these, never the event loop nor the threads that tokenize other requests.
COMPILE_THREADS = 2


class GrammarCache:
    """Thread-safe: the core's input thread compiles while the runner reads."""

    def __init__(self, tokenizer_json: str | Path, eos_token_ids: list[int], vocab_size: int):
        self.tokenizer_json = str(tokenizer_json)
        self.eos_token_ids = list(eos_token_ids)
        self.vocab_size = vocab_size
        self._compiler: _core.GrammarCompiler | None = None
        self._grammars: OrderedDict[tuple[str, str], _core.Grammar] = OrderedDict()
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
            grammar = compiler.compile(*key)  # the GIL is released meanwhile
        except ValueError as e:
            raise InvalidRequestError(f"structured_outputs: {e}") from None
        with self._lock:
            self._grammars[key] = grammar
            if len(self._grammars) > MAX_CACHED_GRAMMARS:
                self._grammars.popitem(last=False)
        return grammar

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
