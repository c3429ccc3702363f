"""`LLM`: the offline, synchronous API — give it prompts, get completions back."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from asyncllm import envs
from asyncllm.config import EngineArgs
from asyncllm.default_model import DEFAULT_MODEL
from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.input_processor import PromptType
from asyncllm.frontend.llm_engine import LLMEngine
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.outputs import RequestOutput
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline generation: `LLM(model=path).generate(prompts, SamplingParams(...))`.

    With no model, `LLM()` runs `asyncllm-tiny`, the small model the package ships.

    Keyword arguments are `EngineArgs` fields; unknown ones are rejected by name.
    The engine core runs in its own process (a fresh interpreter, so scripts need
    no `__main__` guard); `multiprocess=False` (or ASYNCLLM_MULTIPROCESS=0) keeps
    it in this process for debugging. `shutdown()` (or leaving a `with` block, or
    garbage collection, or interpreter exit) stops it.
    """

    def __init__(
        self, model: str = DEFAULT_MODEL, multiprocess: bool | None = None, **engine_args: Any
    ) -> None:
        self.engine_args = EngineArgs.from_kwargs(model=model, **engine_args)
        if multiprocess is None:
            multiprocess = envs.multiprocess()
        self.engine = LLMEngine(self.engine_args, multiprocess=multiprocess)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stop the engine core and release its resources. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A bad prompt
        or parameter raises before any request is submitted."""
        prompt_list = _as_prompt_list(prompts)
        if sampling_params is None:
            params_list = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompt_list)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise InvalidRequestError(
                    f"got {len(params_list)} SamplingParams for {len(prompt_list)} prompts: "
                    "pass one, or one per prompt"
                )
        # Validate every prompt before submitting any, so a bad one leaves no
        # half-submitted batch behind.
        for i, prompt in enumerate(prompt_list):
            try:
                self.engine.input_processor.process(prompt)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}") from None
        ids = []
        for prompt, params in zip(prompt_list, params_list, strict=True):
            if params.output_kind != RequestOutputKind.FINAL_ONLY:
                params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
            rid = self.engine.next_request_id()
            self.engine.add_request(rid, prompt, params)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req")
        start = time.perf_counter()
        num_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        num_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = time.perf_counter() - start
                        bar.set_postfix_str(f"{num_tokens / elapsed:.1f} tok/s", refresh=False)
        except BaseException:
            self.engine.abort_request(i for i in ids if i not in results)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]


def _as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[PromptType]:
    if isinstance(prompts, str | dict):
        return [prompts]
    if (
        isinstance(prompts, Sequence)
        and prompts
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts)
    ):
        return [prompts]  # type: ignore[list-item]  # one prompt given as token ids
    return list(prompts)  # type: ignore[arg-type]
