"""`LLM`: the offline, synchronous API — give it prompts, get completions back."""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from asyncllm import envs
from asyncllm.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    check_tools,
    prepare_messages,
    resolve_template_source,
)
from asyncllm.config import EngineArgs
from asyncllm.default_model import DEFAULT_MODEL
from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.input_processor import PromptType
from asyncllm.frontend.llm_engine import LLMEngine
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import EmbeddingRequestOutput, RequestOutput
from asyncllm.placement import placement
from asyncllm.pooling_params import PoolingParams
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
        if multiprocess is None:
            multiprocess = envs.multiprocess()
        # Offline: the front end idles during `generate` (asyncllm.placement).
        self.engine_args = placement(
            EngineArgs.from_kwargs(model=model, **engine_args),
            "offline",
            in_process=not multiprocess,
        )
        self.engine = LLMEngine(self.engine_args, multiprocess=multiprocess)
        self._finalizer = weakref.finalize(self, self.engine.shutdown)
        self._templates: dict[str | None, ChatTemplate] = {}

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
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. A bad prompt
        or parameter raises before any request is submitted. `lora_request`: one
        adapter for every prompt, or one (or None: the base model) per prompt."""
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
        self._check_prompts(prompt_list)
        loras = _per_prompt(lora_request, len(prompt_list))
        ids = []
        with self.engine.submitting_together():
            for prompt, params, lora in zip(prompt_list, params_list, loras, strict=True):
                if params.output_kind != RequestOutputKind.FINAL_ONLY:
                    params = params.clone(output_kind=RequestOutputKind.FINAL_ONLY)
                rid = self.engine.next_request_id()
                self.engine.add_request(rid, prompt, params, lora)
                ids.append(rid)
        return self._run(ids, use_tqdm)  # type: ignore[return-value]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
        *,
        pooling: str | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """Every prompt's embedding (`out.outputs.embedding`), in input order: its
        final hidden states pooled by `pooling_params`, or by the `pooling` ("last",
        the default, or "mean"), `normalize` (default on) and `dimensions`
        shortcuts. They run as prompt-only requests of the same scheduler as
        `generate`'s. A bad prompt raises before any request is submitted."""
        if pooling_params is None:
            defaults = PoolingParams()
            pooling_params = PoolingParams(
                defaults.pooling if pooling is None else pooling,
                defaults.normalize if normalize is None else normalize,
                dimensions,
            )
        elif pooling is not None or normalize is not None or dimensions is not None:
            raise InvalidRequestError(
                "pass pooling_params, or the pooling/normalize/dimensions shortcuts, not both"
            )
        prompt_list = _as_prompt_list(prompts)
        self._check_prompts(prompt_list)
        states = []
        with self.engine.submitting_together():
            for prompt in prompt_list:
                rid = self.engine.next_request_id()
                states.append(self.engine.add_embedding(rid, prompt, pooling_params))
        outputs = self._run([s.request_id for s in states], use_tqdm)
        for i, state in enumerate(states):
            if state.error is not None:
                raise InvalidRequestError(f"prompt {i}: {state.error}")
        return outputs  # type: ignore[return-value]

    def _check_prompts(self, prompt_list: list[PromptType]) -> None:
        """Validate every prompt before submitting any, so a bad one leaves no
        half-submitted batch behind."""
        for i, prompt in enumerate(prompt_list):
            try:
                self.engine.input_processor.process(prompt)
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"prompt {i}: {exc}") from None

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        *,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of OpenAI-style messages)
        or to several (a list of them), rendered through the model's chat template
        (or `chat_template`: a file or the template itself) as the server renders
        them; `tools` (OpenAI function specs) go into the template. Outputs are the
        raw replies, as from `generate` (vLLM's `LLM.chat`); reading tool calls out
        of them is the server's job."""
        if isinstance(messages, Sequence) and messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        template = self._chat_template(chat_template)
        extra: dict[str, Any] = {}
        try:
            if tools is not None:
                extra["tools"] = check_tools(tools)
            extra.update(chat_template_kwargs or {})
            texts = []
            for i, conversation in enumerate(conversations):
                try:
                    texts.append(
                        template.render(
                            prepare_messages(conversation), add_generation_prompt, extra
                        )
                    )
                except ChatTemplateError as exc:
                    raise ChatTemplateError(f"conversation {i}: {exc}") from None
        except ChatTemplateError as exc:
            raise InvalidRequestError(str(exc)) from None
        # The template writes the special tokens itself (BOS included).
        tok = self.engine.tokenizer
        prompts: list[PromptType] = [
            {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
            for text in texts
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _chat_template(self, option: str | None) -> ChatTemplate:
        """The compiled template for `option` (None: the model's), found as the
        server finds it and compiled once."""
        template = self._templates.get(option)
        if template is None:
            tok = self.engine.tokenizer
            directories = (tok.directory, self.engine.args.model)
            source = resolve_template_source(option, tok.config, directories)
            if source is None:
                raise InvalidRequestError(
                    "this model has no chat template: pass chat_template= (a file or the "
                    "template itself), or use generate()"
                )
            template = self._templates[option] = ChatTemplate(source, tok.bos_token, tok.eos_token)
        return template

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput | EmbeddingRequestOutput]:
        results: dict[str, RequestOutput | EmbeddingRequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, unit="req")
        start = time.perf_counter()
        num_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if isinstance(out, EmbeddingRequestOutput):
                            num_tokens += len(out.prompt_token_ids)
                        else:
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


def _per_prompt(
    lora: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * num_prompts
    loras = list(lora)
    if len(loras) != num_prompts:
        raise InvalidRequestError(
            f"got {len(loras)} LoRA requests for {num_prompts} prompts: pass one, or one per prompt"
        )
    return loras
