"""The in-process engine: front-end processing around an `EngineCore` in the
caller's process. `LLM` drives it; the multiprocess client will replace the
direct core calls with messages to the core's process."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from asyncllm.config import EngineArgs
from asyncllm.engine.core import EngineCore
from asyncllm.engine.messages import EngineCoreRequest
from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.input_processor import InputProcessor, PromptType, fan_out
from asyncllm.frontend.output_processor import OutputProcessor, ParentState
from asyncllm.frontend.tokenizer import Tokenizer, resolve_eos_token_ids
from asyncllm.models.hf_config import load_hf_config
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        hf_config = load_hf_config(args.model)
        self.config = args.resolve(hf_config)
        self.tokenizer = Tokenizer(self.config.tokenizer)
        eos = resolve_eos_token_ids(self.config.model, hf_config, self.tokenizer)
        self.core = EngineCore(self.config, hf_config, eos)
        self.input_processor = InputProcessor(
            self.tokenizer, self.config.max_model_len, self.core.vocab_size
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self._parents: dict[str, ParentState] = {}
        self._counter = itertools.count()
        self._wire_ids = itertools.count()

    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams | None = None
    ) -> None:
        """Tokenize, validate and submit one request (its n children for n > 1).
        Raises InvalidRequestError without touching the engine on a bad request."""
        params = params or SamplingParams()
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, prompt_ids = self.input_processor.process(prompt)
        children = fan_out(params)
        core_ids = [next(self._wire_ids) for _ in children]
        core_reqs = [
            EngineCoreRequest(cid, prompt_ids, p) for cid, p in zip(core_ids, children, strict=True)
        ]
        requests = [self.core.make_request(r) for r in core_reqs]  # validate all first
        parent = ParentState(request_id, text, prompt_ids, params)
        self.output_processor.add_request(parent, core_ids)
        self._parents[request_id] = parent
        for request in requests:
            self.core.add_request(request)

    def abort_request(self, request_ids: Iterable[str]) -> list[RequestOutput]:
        core_ids: list[int] = []
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is not None:
                core_ids.extend(c.core_id for c in parent.children if c.finish_reason is None)
        outputs, _ = self.output_processor.process_outputs(self.core.abort_requests(core_ids))
        return self._finish(outputs)

    def step(self) -> list[RequestOutput]:
        core_outputs = self.core.step()
        outputs, stopped = self.output_processor.process_outputs(core_outputs.outputs)
        if stopped:  # a stop string ended these: the core stops computing them now
            self.core.abort_requests(stopped)
        return self._finish(outputs)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def next_request_id(self) -> str:
        return str(next(self._counter))

    def _finish(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        for out in outputs:
            if out.finished:
                self._parents.pop(out.request_id, None)
        return outputs
