"""The synchronous engine behind `LLM`: front-end processing around an engine core
that runs in its own process (the default) or, for debugging, directly in the
caller's process (`multiprocess=False`), stepped by the caller."""

from __future__ import annotations

import itertools
import queue
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from asyncllm import _core
from asyncllm._core import AddRequest
from asyncllm.config import EngineArgs
from asyncllm.engine.core import EngineCore, build_engine_core
from asyncllm.engine.overlap import OverlapStepper
from asyncllm.engine.wire import to_wire
from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.frontend.core_client import MPClient
from asyncllm.frontend.dp_client import DPClient, make_client
from asyncllm.frontend.input_processor import InputProcessor, PromptType, fan_out
from asyncllm.frontend.output_processor import AnyRequestOutput, OutputProcessor, ParentState
from asyncllm.frontend.pooling_outputs import (
    EmbeddingState,
    check_pooling_params,
    embedding_request,
)
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.lora.request import LoRARequest
from asyncllm.messages import EngineCoreRequest
from asyncllm.pooling_params import PoolingParams
from asyncllm.sampling_params import SamplingParams
from asyncllm.tracing import Tracer

_DEAD_POLL_S = 1.0
_MAX_PENDING_BATCHES = 64  # bounded: a caller that stops stepping makes the core wait
_PUT_POLL_S = 0.1


class LLMEngine:
    def __init__(self, args: EngineArgs, multiprocess: bool = True) -> None:
        self.args = args
        self.tokenizer = Tokenizer(args.tokenizer or args.model)
        self.client: MPClient | DPClient | None = None
        self.core: EngineCore | None = None
        self._stepper: OverlapStepper | None = None
        # This process's half of the timeline (the core writes the other half).
        self.tracer = Tracer(args.trace_dir, "frontend") if args.trace_dir else None
        if multiprocess:
            self._batches: queue.Queue[_core.OutputBatch | EngineDeadError] = queue.Queue(
                _MAX_PENDING_BATCHES
            )
            try:
                self.client = make_client(args, self._on_output, self._on_dead, tracer=self.tracer)
            except BaseException:
                if self.tracer is not None:
                    self.tracer.close()
                raise
            ready = self.client.ready
            self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
            self.hidden_size = ready.hidden_size
        else:
            self.core = build_engine_core(args)
            if self.core.config.async_scheduling:
                self._stepper = OverlapStepper(self.core)
            self.max_model_len = self.core.config.max_model_len
            self.vocab_size = self.core.vocab_size
            self.hidden_size = self.core.hidden_size
        self.input_processor = InputProcessor(self.tokenizer, self.max_model_len, self.vocab_size)
        self.output_processor = OutputProcessor(self.tokenizer, self.tracer)
        self._parents: dict[str, ParentState | EmbeddingState] = {}
        self._counter = itertools.count()
        self._wire_ids = itertools.count()
        self._held: list[list[AddRequest]] | None = None  # requests submitting_together holds

    @contextmanager
    def submitting_together(self) -> Iterator[None]:
        """Within, requests are held and sent to the core process in one message on
        exit, so the core admits them in one step. Sent one by one, the first steps
        take whatever has arrived, and since a kernel's float rounding can depend on
        a step's rows, the same `LLM.generate` call could give other tokens run to
        run (16 seeded SmolLM2 streams: 7 of 16 differed)."""
        if self.client is None:  # an in-process core steps only when asked
            yield
            return
        self._held = []
        try:
            yield
        finally:
            held, self._held = self._held, None
            if held:
                self.client.add_request_groups(held)

    def _submit(self, wire: list[AddRequest]) -> None:
        """One prompt's requests (its n children) to the core, or held."""
        assert self.client is not None
        if self._held is not None:
            self._held.append(wire)
        else:
            self.client.add_requests(wire)

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Tokenize, validate and submit one request (its n children for n > 1), with
        the adapter `lora_request` names if any. Raises InvalidRequestError without
        touching the engine on a bad request."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, prompt_ids = self.input_processor.process(prompt)
        self.input_processor.check_params(params)
        children = fan_out(params)
        core_ids = [next(self._wire_ids) for _ in children]
        lid, lname, lpath = LoRARequest.wire_fields(lora_request)
        reqs = [
            EngineCoreRequest(cid, prompt_ids, p, lora_int_id=lid, lora_name=lname, lora_path=lpath)
            for cid, p in zip(core_ids, children, strict=True)
        ]
        if self.core is not None:
            requests = [self.core.make_request(r) for r in reqs]  # validate all first
        parent = ParentState(request_id, text, prompt_ids, params)
        self.output_processor.add_request(parent, core_ids)
        self._parents[request_id] = parent
        if self.client is not None:
            self._submit([to_wire(r, self.max_model_len) for r in reqs])
        else:
            assert self.core is not None
            for request in requests:
                self.core.add_request(request)

    def add_embedding(
        self, request_id: str, prompt: PromptType, params: PoolingParams
    ) -> EmbeddingState:
        """Tokenize, validate and submit one embedding request; its state says
        whether it failed once it finished. Raises InvalidRequestError without
        touching the engine on a bad request."""
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        _, prompt_ids = self.input_processor.process(prompt)
        check_pooling_params(params, self.hidden_size)
        state = EmbeddingState(request_id, prompt_ids, params, next(self._wire_ids))
        request = embedding_request(state.core_id, prompt_ids, params)
        if self.core is not None:
            core_request = self.core.make_request(request)
        self.output_processor.add_embedding(state)
        self._parents[request_id] = state
        if self.client is not None:
            self._submit([to_wire(request, self.max_model_len)])
        else:
            assert self.core is not None
            self.core.add_request(core_request)
        return state

    def abort_request(self, request_ids: Iterable[str]) -> list[AnyRequestOutput]:
        """Abort requests; returns their final outputs (finish_reason "abort")."""
        core_ids: list[int] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if isinstance(parent, EmbeddingState):
                core_ids.extend([] if parent.finished else [parent.core_id])
            elif parent is not None:
                core_ids.extend(c.core_id for c in parent.children if c.finish_reason is None)
        self._abort_in_core(core_ids)
        return self._finish(self.output_processor.abort(core_ids))

    def step(self) -> list[AnyRequestOutput]:
        """Run (or wait for) one engine step and return the outputs due."""
        if self.core is not None:
            step_out = self._stepper.step() if self._stepper else self.core.step()
            if step_out is None:  # overlap: the first step was launched, none finished
                return []
            batch = _core.decode_message(step_out.encode())[1]
        else:
            batch = self._next_batch()
        outputs, stopped = self.output_processor.process_outputs(batch)
        if stopped:  # a stop string ended these: the core stops computing them now
            self._abort_in_core(stopped)
        return self._finish(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def call_utility(self, method: str, args: object = None, timeout: float = 30.0) -> object:
        """Raises TimeoutError after `timeout` seconds (the call is then forgotten)."""
        if self.client is None:
            raise RuntimeError("utility calls need the multiprocess engine")
        future = self.client.call_utility(method, args)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def shutdown(self) -> None:
        if self._stepper is not None:
            self._stepper.close()
        if self.core is not None:  # in-process: its trace, its tensor-parallel workers
            self.core.close()
        if self.client is not None:
            self.client.shutdown()
        if self.tracer is not None:
            self.tracer.close()

    def _on_output(self, batch: _core.OutputBatch) -> None:
        """Receiver thread: wait while the queue is full (back-pressure on the core)."""
        while True:
            client = getattr(self, "client", None)
            if client is not None and not client.is_alive:
                return  # shut down or dead: nobody will step for it
            try:
                self._batches.put(batch, timeout=_PUT_POLL_S)
                return
            except queue.Full:
                pass

    def _on_dead(self, error: EngineDeadError) -> None:
        """Monitor thread: wake a caller waiting for a batch (if the queue is full,
        the caller finds `client.dead` once it has drained it)."""
        try:
            self._batches.put_nowait(error)
        except queue.Full:
            pass

    def _next_batch(self) -> _core.OutputBatch:
        assert self.client is not None
        while True:
            try:
                item = self._batches.get(timeout=_DEAD_POLL_S)
            except queue.Empty:
                if self.client.dead is not None:
                    raise self.client.dead from None
                continue
            if isinstance(item, EngineDeadError):
                raise item
            return item

    def _abort_in_core(self, core_ids: list[int]) -> None:
        if not core_ids:
            return
        if self.core is not None:
            self.core.abort_requests(core_ids)
        elif self.client is not None:
            self.client.abort_requests(core_ids)

    def _finish(self, outputs: list[AnyRequestOutput]) -> list[AnyRequestOutput]:
        for out in outputs:
            if out.finished:
                self._parents.pop(out.request_id, None)
        return outputs
