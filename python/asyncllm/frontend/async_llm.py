"""`AsyncLLM`: the asyncio front end for serving many concurrent streams.

One output-handler task per engine takes each step's decoded batch, runs the Rust
detokenizer and stop-string step for every request in it in one call, and feeds
the per-request collectors; `generate()` consumers read from their collector.
A stop-string match finishes the request for the consumer at once and aborts it
in the core. If the core dies, every waiting `generate()` raises
`EngineDeadError` and new requests fail fast with it.

Failures: a batch the output processor cannot process (an Exception) fails the
requests it names (with `OutputProcessingError`) and the engine keeps serving
the others, for that processing only touches those requests' state. A Rust panic
there (pyo3's PanicException, a BaseException) is fatal instead: the
detokenizer's state can no longer be trusted. The output handler task itself
ending is fatal too, like the core's death. Batches wait for the handler in a
bounded queue: when the event loop falls behind, the receiver thread blocks, and
back-pressure reaches the core's busy loop through the sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import queue
import weakref
from collections.abc import AsyncGenerator
from typing import Any

from asyncllm import _core, envs
from asyncllm.config import EngineArgs
from asyncllm.engine.wire import to_wire
from asyncllm.errors import EngineDeadError, InvalidRequestError, OutputProcessingError
from asyncllm.frontend.core_client import MPClient
from asyncllm.frontend.dp_client import DPClient, make_client, merge_stats
from asyncllm.frontend.input_processor import InputProcessor, PromptType, fan_out
from asyncllm.frontend.output_collector import RequestOutputCollector
from asyncllm.frontend.output_processor import OutputProcessor, ParentState
from asyncllm.frontend.pooling_outputs import (
    EmbeddingState,
    check_pooling_params,
    embedding_request,
)
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.lora.request import LoRARequest
from asyncllm.messages import EngineCoreRequest
from asyncllm.outputs import EmbeddingRequestOutput, RequestOutput
from asyncllm.placement import placement
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import RequestOutputKind, SamplingParams
from asyncllm.tracing import Tracer, now_ns

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 10.0
# Step batches waiting for the output handler. Small: a batch holds one step, and
# a full queue is what makes the core wait for a lagging event loop.
_MAX_PENDING_BATCHES = 64
_PUT_POLL_S = 0.1  # how often a receiver blocked on a full queue checks for shutdown


class AsyncLLM:
    """Streams completions: `async for out in engine.generate(prompt, params, id)`.

    The engine core runs in its own process by default (`multiprocess=False`, or
    ASYNCLLM_MULTIPROCESS=0, runs it in a thread of this process for debugging).
    """

    def __init__(
        self,
        args: EngineArgs,
        *,
        multiprocess: bool | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        if multiprocess is None:
            multiprocess = envs.multiprocess()
        # The front end streams while the model runs (asyncllm.placement).
        args = placement(args, "async", in_process=not multiprocess)
        self.args = args
        self.tokenizer = Tokenizer(args.tokenizer or args.model)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._batches: queue.Queue[_core.OutputBatch] = queue.Queue(_MAX_PENDING_BATCHES)
        self._wakeup: asyncio.Event | None = None  # set when batches arrive
        self._dead_event: asyncio.Event | None = None  # set once when the engine dies
        self._closed = False
        # This process's half of the timeline (the core writes the other half).
        self.tracer = Tracer(args.trace_dir, "frontend") if args.trace_dir else None
        try:
            self.client = make_client(
                args,
                self._on_output,
                self._on_dead,
                in_thread=not multiprocess,
                startup_timeout=startup_timeout,
                tracer=self.tracer,
            )
        except BaseException:
            if self.tracer is not None:
                self.tracer.close()
            raise
        self._finalizer = weakref.finalize(self, _shutdown, self.client, self.tracer)
        ready = self.client.ready
        self.max_model_len = ready.max_model_len
        self.hidden_size = ready.hidden_size  # the length of an embedding
        self.input_processor = InputProcessor(self.tokenizer, ready.max_model_len, ready.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.tracer)
        self._collectors: dict[str, RequestOutputCollector[Any]] = {}
        self._parents: dict[str, ParentState] = {}
        self._embeddings: dict[str, EmbeddingState] = {}
        self._wire_ids = itertools.count()
        self._request_ids = itertools.count()
        self._handler: asyncio.Task[None] | None = None
        self._dead: EngineDeadError | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args, **kwargs)

    # -- status -----------------------------------------------------------------------

    @property
    def errored(self) -> bool:
        handler = self._handler
        lost_handler = handler is not None and handler.done() and not self._closed
        return self._dead is not None or self.client.dead is not None or lost_handler

    @property
    def is_running(self) -> bool:
        return self.client.is_alive and not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self._dead or self.client.dead or EngineDeadError("the engine is not running")

    # -- requests -----------------------------------------------------------------------

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream a request's outputs (CUMULATIVE, DELTA or FINAL_ONLY as its params
        say), with the adapter `lora_request` names if any. Closing the generator or
        cancelling its consumer aborts the request."""
        self._start_handler()
        if not self.is_running:
            raise self.dead_error
        params = sampling_params or SamplingParams()
        lid, lname, lpath = LoRARequest.wire_fields(lora_request)
        if request_id is None:
            request_id = f"req-{next(self._request_ids)}"
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        text, prompt_ids = self.input_processor.process(prompt)
        self.input_processor.check_params(params)
        children = fan_out(params)
        core_ids = [next(self._wire_ids) for _ in children]
        parent = ParentState(request_id, text, prompt_ids, params)
        collector: RequestOutputCollector[RequestOutput] = RequestOutputCollector(
            params.output_kind
        )
        self.output_processor.add_request(parent, core_ids)
        self._collectors[request_id] = collector
        self._parents[request_id] = parent
        finished = False
        try:
            self.client.add_requests(
                [
                    to_wire(
                        EngineCoreRequest(
                            cid, prompt_ids, p, lora_int_id=lid, lora_name=lname, lora_path=lpath
                        ),
                        self.max_model_len,
                    )
                    for cid, p in zip(core_ids, children, strict=True)
                ]
            )
            while not finished:
                out = collector.get_nowait() or await collector.get()
                if parent.error is not None:
                    raise InvalidRequestError(parent.error)
                finished = out.finished
                yield out
        finally:
            if not finished:  # cancelled, closed early, or failed: stop it in the core
                self._abort_now(request_id)
            self._collectors.pop(request_id, None)
            self._parents.pop(request_id, None)

    async def embed(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
    ) -> EmbeddingRequestOutput:
        """The prompt's embedding: its final hidden states pooled as `pooling_params`
        say (default: last token, normalized). It runs in the same steps as the
        generation requests, and keeps no KV once its prompt is computed.
        Cancelling the call aborts the request; an abort raises InvalidRequestError."""
        self._start_handler()
        if not self.is_running:
            raise self.dead_error
        params = pooling_params or PoolingParams()
        if request_id is None:
            request_id = f"embd-{next(self._request_ids)}"
        if request_id in self._collectors:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        _, prompt_ids = self.input_processor.process(prompt)
        check_pooling_params(params, self.hidden_size)
        state = EmbeddingState(request_id, prompt_ids, params, next(self._wire_ids))
        collector: RequestOutputCollector[EmbeddingRequestOutput] = RequestOutputCollector(
            RequestOutputKind.FINAL_ONLY
        )
        self.output_processor.add_embedding(state)
        self._collectors[request_id] = collector
        self._embeddings[request_id] = state
        try:
            request = embedding_request(state.core_id, prompt_ids, params)
            self.client.add_requests([to_wire(request, self.max_model_len)])
            out = collector.get_nowait() or await collector.get()
            if state.error is not None:
                raise InvalidRequestError(state.error)
            return out
        finally:
            if not state.finished:  # cancelled or failed: stop it in the core
                self._abort_now(request_id)
            self._collectors.pop(request_id, None)
            self._embeddings.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate()` ends with finish_reason "abort" (its
        `embed()` raises InvalidRequestError)."""
        self._abort_now(request_id)

    def _core_ids_to_abort(self, request_id: str) -> list[int]:
        """The core ids of a request's unfinished parts."""
        embedding = self._embeddings.get(request_id)
        if embedding is not None:
            return [] if embedding.finished else [embedding.core_id]
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        return [c.core_id for c in parent.children if c.finish_reason is None]

    def _abort_now(self, request_id: str) -> None:
        core_ids = self._core_ids_to_abort(request_id)
        if not core_ids:
            return
        for out in self.output_processor.abort(core_ids):
            collector = self._collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        try:
            self.client.abort_requests(core_ids)
        except EngineDeadError:
            pass  # nothing left to abort

    async def check_health(self, timeout: float = _HEALTH_TIMEOUT_S) -> None:
        """A round trip through the core's busy loop; raises EngineDeadError if the
        core is dead or does not answer within `timeout` seconds (a hung core)."""
        if not self.is_running:
            raise self.dead_error
        future = self.client.call_utility("check_health")
        try:
            await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            raise EngineDeadError(
                f"the engine core did not answer a health check within {timeout:.1f}s"
            ) from None

    async def call_utility(self, method: str, args: Any = None, timeout: float = 30.0) -> Any:
        """Call a core utility (get_stats, reset_prefix_cache, get_step_timings).
        With data parallelism every core runs it and the result is their list.
        Raises TimeoutError after `timeout` seconds (the call is then forgotten)."""
        future = self.client.call_utility(method, args)
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    async def wait_until_dead(self) -> EngineDeadError:
        """Return when the engine dies (the core, or this front end's output
        handler), with the error every request got. For supervisors: the server
        exits non-zero on it."""
        self._start_handler()
        assert self._dead_event is not None
        await self._dead_event.wait()
        return self.dead_error

    async def get_stats(self) -> dict[str, Any]:
        """The core's scheduler state; with data parallelism, the cores' merged,
        each core's own under "engines"."""
        stats = await self.call_utility("get_stats")
        return merge_stats(stats) if isinstance(self.client, DPClient) else stats  # type: ignore[no-any-return]

    def shutdown(self) -> None:
        """Stop the engine core and release every resource. Idempotent."""
        self._closed = True
        if self._handler is not None and not self._handler.done():
            self._handler.cancel()
        self._finalizer()
        error = EngineDeadError("the engine has been shut down")
        for collector in self._collectors.values():
            collector.put_error(error)

    # -- the output handler -------------------------------------------------------------

    def _start_handler(self) -> None:
        if self._handler is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._dead_event = asyncio.Event()
        if self.errored:
            self._dead_event.set()
        self._handler = self._loop.create_task(self._output_handler(), name="asyncllm-output")
        self._handler.add_done_callback(self._on_handler_done)

    def _on_output(self, batch: _core.OutputBatch) -> None:
        """Receiver thread: queue the batch for the event loop, waiting while the
        queue is full (back-pressure), and wake the output handler."""
        try:
            self._batches.put_nowait(batch)
        except queue.Full:
            while True:
                client = getattr(self, "client", None)
                if self._closed or (client is not None and not client.is_alive):
                    return  # nobody will read it: every request has failed or ended
                try:
                    self._batches.put(batch, timeout=_PUT_POLL_S)
                    break
                except queue.Full:
                    pass
        loop, wakeup = self._loop, self._wakeup
        if loop is not None and wakeup is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed
                loop.call_soon_threadsafe(wakeup.set)

    def _on_dead(self, error: EngineDeadError) -> None:
        """Monitor thread: fail every waiting request."""
        loop = self._loop
        if loop is None:
            self._fail_all(error)
            return
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(self._fail_all, error)

    def _fail_all(self, error: EngineDeadError) -> None:
        if self._dead is None:
            self._dead = error
        for collector in self._collectors.values():
            collector.put_error(error)
        if self._dead_event is not None:
            self._dead_event.set()

    def _on_handler_done(self, task: asyncio.Task[None]) -> None:
        """The output handler only ends by shutdown; any other end is fatal, for
        nothing else would deliver outputs to the waiting requests."""
        if self._closed:
            return
        if task.cancelled():  # most often the event loop ending (asyncio.run's exit)
            cause = "it was cancelled"
        else:
            cause = repr(task.exception())
            logger.error("the output handler failed: %s", cause)
        with contextlib.suppress(RuntimeError):  # a closing loop
            self._fail_all(EngineDeadError(f"the front end's output handler stopped: {cause}"))

    async def _output_handler(self) -> None:
        batches = self._batches
        wakeup = self._wakeup
        assert wakeup is not None
        get = batches.get_nowait
        while True:
            try:
                batch = get()
            except queue.Empty:
                await wakeup.wait()
                wakeup.clear()  # then drain: a batch put after this sets it again
                continue
            self._process_batch(batch)

    def _process_batch(self, batch: _core.OutputBatch) -> None:
        """One step's outputs to their collectors (the front end's hot path)."""
        tracer = self.tracer
        if tracer is not None:
            t0 = now_ns()
        try:
            outputs, stopped = self.output_processor.process_outputs(batch)
        except Exception as exc:
            self._fail_batch(batch, exc)
            return
        except BaseException as exc:  # a Rust panic (not an Exception): fatal
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            logger.critical("output processing panicked", exc_info=exc)
            self._fail_all(EngineDeadError(f"the front end's output processing panicked: {exc!r}"))
            return
        if tracer is not None:
            t1 = now_ns()
        collectors = self._collectors
        for out in outputs:
            collector = collectors.get(out.request_id)
            if collector is not None:
                collector.put(out)
        if stopped:
            with contextlib.suppress(EngineDeadError):
                self.client.abort_requests(stopped)
        if tracer is not None:
            t2 = now_ns()
            tracer.complete("collect", t1, t2, {"requests": len(outputs)})
            tracer.complete("process_batch", t0, t2, {"outputs": len(batch)})

    def _fail_batch(self, batch: _core.OutputBatch, exc: BaseException) -> None:
        """Fail the requests a batch names, abort them in the core, keep serving."""
        logger.error("processing an output batch failed", exc_info=exc)
        error = OutputProcessingError(
            f"the front end could not process this request's output: {type(exc).__name__}: {exc}"
        )
        children = self.output_processor.children
        parents = {}
        for wire_id in batch.wire_ids:
            child = children.get(wire_id)
            if child is not None:
                parents[child.parent.request_id] = child.parent
        for request_id, parent in parents.items():
            core_ids = [c.core_id for c in parent.children if c.finish_reason is None]
            try:
                self.output_processor.abort(core_ids)
            except Exception as again:  # forget them anyway
                logger.error("dropping request %s after a failed abort: %s", request_id, again)
                for core_id in core_ids:
                    children.pop(core_id, None)
            collector = self._collectors.get(request_id)
            if collector is not None:
                collector.put_error(error)
            with contextlib.suppress(EngineDeadError):
                self.client.abort_requests(core_ids)


def _shutdown(client: MPClient | DPClient, tracer: Tracer | None) -> None:
    """Stop the core, then write this process's trace for the last time."""
    client.shutdown()
    if tracer is not None:
        tracer.close()
