"""What the completions and chat endpoints share: the served model's names, prompt
length checks, error mapping, in-flight tracking (for shutdown), metrics per
request, and merging the streams of several prompts."""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from asyncllm.errors import EngineDeadError, InvalidRequestError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.lora.request import LoRARequest
from asyncllm.outputs import CompletionOutput, RequestOutput
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.config import ServerConfig
from asyncllm.server.limits import Admission, RequestLimits
from asyncllm.server.lora import ServedAdapters
from asyncllm.server.metrics import RequestTimer, ServerMetrics
from asyncllm.server.protocol import APIError, bad_request
from asyncllm.server.token_text import TokenText
from asyncllm.token_checks import check_token_ids, max_tokens_room

logger = logging.getLogger(__name__)
T = TypeVar("T")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_OFF_LOOP = ThreadPoolExecutor(max_workers=4, thread_name_prefix="asyncllm-server")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """Run `fn(*args)` on the server's worker threads: tokenizing, rendering chat
    templates and building large responses, so that one request cannot stall the
    event loop (and with it every stream)."""
    return await asyncio.get_running_loop().run_in_executor(_OFF_LOOP, fn, *args)


_PARAM = re.compile(r"\w+")


class ServingBase:
    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        metrics: ServerMetrics,
        admission: Admission | None = None,
        token_text: TokenText | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.config = config
        self.metrics = metrics
        self.model_name = config.served_model_names[0]
        self.max_model_len = engine.max_model_len
        self.limits = RequestLimits(config, engine.max_model_len)
        self.admission = admission or Admission(config.max_concurrent_requests)
        self.token_text = token_text or TokenText(engine.tokenizer)
        self.in_flight: set[str] = set()  # engine request ids, aborted on shutdown
        # the adapters clients may name (shared by every serving: see app.build_app)
        self.adapters = ServedAdapters(config.served_model_names)

    def echoed_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter a request ran under (its
        name, as vLLM answers), else the served model's first name."""
        lora = self.adapters.lookup(model)
        return self.model_name if lora is None else lora.lora_name

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an
        unknown name."""
        return self.adapters.lookup(model)

    def check_engine(self) -> None:
        if self.engine.errored:
            raise APIError(503, "the engine is not running", code="engine_dead")

    async def check_params(self, params: SamplingParams) -> None:
        """What the engine would reject only after the response has started (ids
        against the vocabulary, the seeds of the n choices, a constraint that does
        not compile): a 400 up front. The constraint compiles off the event loop;
        the check below then finds it cached."""
        processor = self.engine.input_processor
        try:
            if params.structured_outputs is not None:
                await processor.grammars.compile_async(params.structured_outputs)
            processor.check_params(params)
        except InvalidRequestError as exc:
            match = _PARAM.match(str(exc))
            raise bad_request(str(exc), match.group(0) if match else None) from None

    def check_prompt_ids(self, ids: list[int], param: str) -> None:
        try:
            check_token_ids(ids, self.engine.input_processor.vocab_size, param)
        except InvalidRequestError as exc:
            raise bad_request(str(exc), param) from None

    async def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Tokenize off the event loop (the tokenizer releases the GIL)."""
        (ids,) = await off_loop(self.tokenizer.encode_batch, [text], add_special_tokens)
        return ids

    def max_tokens_for(
        self, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str
    ) -> int:
        """The max_tokens to run with: the request's, or all the room left."""
        self.limits.check_tokens(prompt_len, prompt_param)
        room = max_tokens_room(prompt_len, self.max_model_len)
        if room < 1:
            raise APIError(
                413,
                f"the prompt has {prompt_len} tokens but this model's context is "
                f"{self.max_model_len} tokens (at most {self.max_model_len - 1} for the prompt)",
                param=prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is None:
            return room
        if isinstance(max_tokens, int) and max_tokens > room:
            raise bad_request(
                f"{param}={max_tokens} is too large: the prompt has {prompt_len} tokens and the "
                f"context is {self.max_model_len}, so at most {room} tokens can be generated",
                param,
            )
        return max_tokens

    async def generate(
        self,
        prompt_ids: list[int],
        prompt_text: str | None,
        params: SamplingParams,
        request_id: str,
        timer: RequestTimer,
        lora: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """`AsyncLLM.generate` with metrics and in-flight tracking (under `lora`, the
        adapter `check_model` found); engine errors become APIErrors. Closing it (a
        disconnect) aborts the request."""
        reasons: list[str | None] = [None] * params.n
        self.in_flight.add(request_id)
        try:
            prompt = {"prompt_token_ids": prompt_ids, "prompt": prompt_text}
            async for out in self.engine.generate(prompt, params, request_id, lora):
                new = 0
                for c in out.outputs:
                    new += len(c.token_ids)
                    if c.finish_reason is not None:
                        reasons[c.index] = c.finish_reason
                timer.on_output(new)
                yield out
        except EngineDeadError as exc:
            logger.warning("request %s failed: the engine is not running (%s)", request_id, exc)
            raise APIError(503, "the engine is not running", code="engine_dead") from None
        except InvalidRequestError as exc:
            raise bad_request(str(exc)) from None
        finally:
            self.in_flight.discard(request_id)
            timer.on_finish(reasons)

    async def collect(
        self, outputs: AsyncIterator[RequestOutput], n: int
    ) -> tuple[list[CompletionOutput], Any, int | None]:
        """Joins a DELTA stream into each choice's whole output (text, ids,
        logprobs, how it finished), for the non-streaming endpoints; also returns
        the prompt logprobs, if any came, and the prompt tokens the prefix cache
        served (None until the engine reports them)."""
        texts: list[list[str]] = [[] for _ in range(n)]
        whole = [CompletionOutput(i, "", [], None, []) for i in range(n)]
        prompt_logprobs = None
        num_cached = None
        async for out in outputs:
            if out.prompt_logprobs is not None:
                prompt_logprobs = out.prompt_logprobs
            if out.num_cached_tokens is not None:
                num_cached = out.num_cached_tokens
            for c in out.outputs:
                w = whole[c.index]
                texts[c.index].append(c.text)
                w.token_ids.extend(c.token_ids)
                if c.logprobs:
                    w.logprobs.extend(c.logprobs)  # type: ignore[union-attr]
                w.finish_reason, w.stop_reason = c.finish_reason, c.stop_reason
        for w, parts in zip(whole, texts, strict=True):
            w.text = "".join(parts)
        return whole, prompt_logprobs, num_cached

    async def abort_all(self) -> None:
        for request_id in list(self.in_flight):
            await self.engine.abort(request_id)


def join_body(head: dict[str, Any], choices: list[bytes]) -> bytes:
    """A whole response: `head` with its `choices` spliced in as already
    serialised JSON (each choice is dumped alone, handing the GIL back between
    them, so a large response does not hold it in one piece)."""
    return (
        json.dumps(head, separators=(",", ":"))[:-1].encode()
        + b',"choices":['
        + b",".join(choices)
        + b"]}"
    )


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` (prompt tokens served from the prefix
    cache) goes in `prompt_tokens_details` when the engine reported it."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def sum_cached_tokens(counts: list[int | None]) -> int | None:
    """The prompts' cached tokens together; None when none was reported."""
    known = [c for c in counts if c is not None]
    return sum(known) if known else None


async def gather_first_error(works: list[Coroutine[Any, Any, T]]) -> list[T]:
    """Await all, in order; the first failure cancels the rest and is raised."""
    if len(works) == 1:
        return [await works[0]]
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(w) for w in works]
    except ExceptionGroup as group_error:  # the first failure answers the request
        raise group_error.exceptions[0] from None
    return [task.result() for task in tasks]


_END = object()


async def merge_streams(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Items of several streams as they come (the prompts of one request)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield item
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for item in stream:
                queue.put_nowait(item)
        except Exception as exc:
            queue.put_nowait(exc)
        finally:
            queue.put_nowait(_END)

    tasks = [asyncio.ensure_future(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is _END:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
