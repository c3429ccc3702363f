"""EngineCore: the scheduler, the KV cache and the model runner, driven one step
at a time. It knows token ids only; tokenizing and detokenizing live in the
front end.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncllm.config import EngineArgs, EngineConfig
from asyncllm.core.async_scheduler import AsyncScheduler
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.scheduler_output import NewRequestData, SchedulerOutput
from asyncllm.errors import InvalidRequestError
from asyncllm.lora.request import LoRARequest
from asyncllm.messages import EngineCoreRequest, SchedulerStats, StepOutputs
from asyncllm.models.hf_config import kv_window, longrope_original
from asyncllm.pooling_params import POOLING_TYPES
from asyncllm.structured_output.grammar_cache import GrammarCache
from asyncllm.structured_output.rows import GrammarRows
from asyncllm.token_checks import check_params_token_ids, check_token_ids
from asyncllm.tokenizer_files import resolve_eos_token_ids
from asyncllm.tracing import StepRecorder, TorchProfiler, Tracer
from asyncllm.worker.null_runner import NullModelRunner

if TYPE_CHECKING:
    from asyncllm.lora.adapters import LoadedAdapter
    from asyncllm.worker.model_runner import ModelRunner
    from asyncllm.worker.runner_output import ModelRunnerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, hf_config: Any, eos_token_ids: Iterable[int]) -> None:
        self.config = config
        self.eos_token_ids = frozenset(eos_token_ids)
        # (start, schedule s, execute s, update s, outputs) of recent steps, for the
        # benchmarks (`get_step_timings`); kept only when they ask for them.
        self.step_timings: deque[tuple[float, float, float, float, int]] | None = (
            deque(maxlen=20000) if config.collect_step_timings else None
        )
        self.tracer = Tracer(config.trace_dir, "core") if config.trace_dir else None
        self.profiler = TorchProfiler(config.profile_dir) if config.profile_dir else None
        # The step's hooks: None (nothing recorded, nothing timed) unless tracing,
        # profiling or step timers are on.
        self.recorder: StepRecorder | None = None
        self.runner: ModelRunner | NullModelRunner
        if config.executor == "null":
            self.runner = NullModelRunner(config, hf_config)
        elif config.tensor_parallel_size > 1:  # rank 0 here, the others in workers
            from asyncllm.executor.factory import build_tp_runner

            self.runner = build_tp_runner(config, hf_config)
        else:
            from asyncllm.worker.model_runner import ModelRunner  # the torch model stack

            self.runner = ModelRunner(config, hf_config)
        self.vocab_size = self.runner.vocab_size
        # the length of an embedding (the model's final hidden states)
        self.hidden_size = int(hf_config.hidden_size)
        # Output constraints, compiled in `make_request` (off the busy loop); the
        # runner walks each request's grammar as it samples.
        self.grammars = GrammarCache(
            Path(config.tokenizer) / "tokenizer.json", sorted(self.eos_token_ids), self.vocab_size
        )
        if not isinstance(self.runner, NullModelRunner):
            self.runner.grammar_rows = GrammarRows(self.grammars, config.max_num_seqs)
        self.num_kv_blocks = self.runner.num_blocks
        self.kv_cache = KVCacheManager(
            self.num_kv_blocks,
            config.block_size,
            config.enable_prefix_caching,
            sliding_window=kv_window(hf_config),
            uncached_prompts_over=longrope_original(hf_config),
        )
        # Requests admitted but without an output yet: their prefix-cache hits go
        # out with their first output (see `_first_output_hits`).
        self._awaiting_first_output: dict[int, Request] = {}
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            num_speculative_tokens=(
                0 if config.speculative is None else config.speculative.num_speculative_tokens
            ),
            max_loras=0 if config.lora is None else config.lora.max_loras,
        )
        self._set_recorder()
        logger.info(
            "engine core ready: %d KV blocks of %d tokens, max_model_len=%d, device=%s",
            self.num_kv_blocks,
            config.block_size,
            config.max_model_len,
            config.device,
        )

    # -- requests -------------------------------------------------------------

    def make_request(self, req: EngineCoreRequest) -> Request:
        """Validate and build the core's request (including its prompt block
        hashes). Pure: safe to run off the busy loop. Raises InvalidRequestError."""
        n = len(req.prompt_token_ids)
        limit = self.config.max_model_len
        if n == 0:
            raise InvalidRequestError(f"request {req.request_id!r}: the prompt is empty")
        if n >= limit:
            raise InvalidRequestError(
                f"request {req.request_id!r}: the prompt has {n} tokens; max_model_len={limit} "
                f"leaves room for at most {limit - 1} prompt tokens and one generated token"
            )
        p = req.sampling_params
        check_token_ids(req.prompt_token_ids, self.vocab_size, "prompt")
        check_params_token_ids(p, self.vocab_size)
        if req.pooling is not None:
            self._check_pooling(req)
        grammar = None
        if p.structured_outputs is not None:
            if isinstance(self.runner, NullModelRunner):
                raise InvalidRequestError(
                    f"request {req.request_id!r}: structured_outputs needs a model "
                    "(the null executor samples without one)"
                )
            grammar = self.grammars.compile(p.structured_outputs)  # GIL released
        request = Request(
            req.request_id,
            req.prompt_token_ids,
            p,
            eos_token_ids=self.eos_token_ids,
            max_model_len=limit,
            block_size=self.config.block_size,
            hash_blocks=self.config.enable_prefix_caching,
            arrival_time=req.arrival_time,
            priority=req.priority,
            pooling=req.pooling,
            lora=self._adapter_of(req),
        )
        request.grammar = grammar
        return request

    def _check_pooling(self, req: EngineCoreRequest) -> None:
        """An embedding request needs a model's hidden states and samples nothing."""
        if req.pooling not in POOLING_TYPES:
            raise InvalidRequestError(
                f"request {req.request_id!r}: pooling {req.pooling!r} is not one of "
                + ", ".join(POOLING_TYPES)
            )
        if isinstance(self.runner, NullModelRunner):
            raise InvalidRequestError(
                f"request {req.request_id!r}: embeddings need a model "
                "(the null executor has no hidden states)"
            )
        if self.config.speculative is not None:
            raise InvalidRequestError(
                f"request {req.request_id!r}: embeddings are not served with speculative decoding"
            )

    def _adapter_of(self, req: EngineCoreRequest) -> LoadedAdapter | None:
        """The request's adapter, read into the host's cache unless held there
        (off the busy loop: `make_request` runs on the input thread)."""
        if req.lora_int_id == 0:
            return None
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise InvalidRequestError(
                f"request {req.request_id!r} names LoRA adapter {req.lora_name!r}, but "
                "EngineArgs.enable_lora is False"
            )
        return lora.host.get(  # type: ignore[no-any-return]
            LoRARequest(req.lora_name or "", req.lora_int_id, req.lora_path or "")
        )

    # -- LoRA adapters (utility calls; the server's load/unload endpoints) ------

    def add_lora(self, request: LoRARequest) -> bool:
        """Read an adapter into the host's cache; raises InvalidRequestError."""
        lora = getattr(self.runner, "lora", None)
        if lora is None:
            raise InvalidRequestError("EngineArgs.enable_lora is False: no adapters to load")
        lora.host.get(request)
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (running requests finish with theirs)."""
        lora = getattr(self.runner, "lora", None)
        return bool(lora is not None and lora.host.remove(lora_int_id))

    def lora_stats(self) -> dict[str, Any]:
        """The adapters of running and waiting requests (vLLM's lora_requests_info);
        empty without LoRA."""
        if self.config.lora is None:
            return {}
        s = self.scheduler

        def names(requests: Iterable[Request]) -> list[str]:
            return sorted({r.lora.request.lora_name for r in requests if r.lora is not None})

        return {
            "max_lora": self.config.lora.max_loras,
            "lora_running": names(s.running),
            "lora_waiting": names(s.waiting),
        }

    def list_loras(self) -> list[str]:
        lora = getattr(self.runner, "lora", None)
        return [] if lora is None else lora.host.names()  # type: ignore[no-any-return]

    def add_request(self, req: EngineCoreRequest | Request) -> None:
        request = req if isinstance(req, Request) else self.make_request(req)
        if self.scheduler.id_in_use(request.request_id):
            raise InvalidRequestError(f"request id {request.request_id!r} is already running")
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[int]) -> StepOutputs:
        """Finish the requests now and free their blocks; returns their final outputs."""
        done = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request in done:
            self._awaiting_first_output.pop(request.request_id, None)
        return self.final_outputs([r.request_id for r in done], "abort")

    def final_outputs(
        self, req_ids: list[int], reason: str, errors: list[str | None] | None = None
    ) -> StepOutputs:
        """Outputs that end requests outside a step (aborted, or failed alone)."""
        no_tokens: list[list[int]] = [[] for _ in req_ids]
        return StepOutputs(
            req_ids,
            no_tokens,
            self.scheduler.make_stats(),
            time.time(),
            finish_reasons=[reason] * len(req_ids),
            errors=errors,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step -------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Schedule, run the model, and turn the sampled tokens into outputs: one
        entry per request that produced a token."""
        rec = self.recorder
        if rec is not None:  # the one check while nothing is recorded
            return self._recorded_step(rec)
        so = self.schedule()
        return self.update(so, self.runner.execute_model(so).resolved())

    def _recorded_step(self, rec: StepRecorder) -> StepOutputs:
        """`step`, with its phases (schedule, execute, update) recorded."""
        t0 = rec.start_step()
        so = self.schedule()
        t1 = rec.phase("schedule", t0, "execute")
        runner_out = self.runner.execute_model(so).resolved()
        t2 = rec.phase("execute", t1, "update")
        out = self.update(so, runner_out)
        n = so.total_num_scheduled_tokens
        rec.end_step(t0, t1, t2, len(so.num_scheduled_tokens), n, len(out.req_ids))
        return out

    def schedule(self) -> SchedulerOutput:
        """The next step's plan (the first half of `step`; the overlap loop calls
        it while the previous step still runs)."""
        so = self.scheduler.schedule()
        if so.new_reqs:
            self._note_admitted(so.new_reqs)
        return so

    def update(self, so: SchedulerOutput, runner_out: ModelRunnerOutput) -> StepOutputs:
        """Apply a step's sampled tokens and build its outputs (the second half of
        `step`)."""
        scheduler = self.scheduler
        if runner_out.verified or runner_out.drafts:
            return self._update_speculative(so, runner_out)
        if runner_out.pooled:
            return self._update_pooled(so, runner_out)
        stepped, any_finished = scheduler.update_from_output(so, runner_out.sampled)
        req_ids = [r.request_id for r in stepped]
        out = StepOutputs(
            req_ids,
            [r.all_token_ids[-1] for r in stepped],  # flat: one new token each
            scheduler.make_stats(),
            time.time(),
        )
        return self._fill_outputs(out, stepped, any_finished, runner_out)

    def _update_pooled(self, so: SchedulerOutput, runner_out: ModelRunnerOutput) -> StepOutputs:
        """`update` for a step that pooled embedding requests: they finish with
        their vector and no token; the others get their sampled token."""
        pooled = runner_out.pooled
        stepped, _ = self.scheduler.update_from_output(so, runner_out.sampled, pooled=pooled)
        req_ids = [r.request_id for r in stepped]
        new_ids = [[] if r.request_id in pooled else [r.all_token_ids[-1]] for r in stepped]
        out = StepOutputs(req_ids, new_ids, self.scheduler.make_stats(), time.time())
        out.embeddings = [pooled.get(rid) for rid in req_ids]
        return self._fill_outputs(out, stepped, True, runner_out)

    def _update_speculative(
        self, so: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> StepOutputs:
        """`update` for a step that verified drafts or proposed some: each request
        gets the tokens it appended, and the new drafts go to the scheduler."""
        scheduler = self.scheduler
        scheduler.num_appended.clear()
        stepped, any_finished = scheduler.update_from_output(
            so, runner_out.sampled, runner_out.verified
        )
        counts = scheduler.num_appended
        new_ids = [r.all_token_ids[-counts.get(r.request_id, 1) :] for r in stepped]
        out = StepOutputs(
            [r.request_id for r in stepped], new_ids, scheduler.make_stats(), time.time()
        )
        if runner_out.drafts:
            scheduler.set_drafts(runner_out.drafts)
        return self._fill_outputs(out, stepped, any_finished, runner_out)

    def _fill_outputs(
        self,
        out: StepOutputs,
        stepped: list[Request],
        any_finished: bool,
        runner_out: ModelRunnerOutput,
    ) -> StepOutputs:
        """The optional columns of a step's outputs: finishes, logprobs, cache hits."""
        req_ids = out.req_ids
        if any_finished:
            out.finish_reasons = [r.finish_reason for r in stepped]
            out.stop_reasons = [r.stop_reason for r in stepped]
        if runner_out.logprobs:
            out.logprobs = [runner_out.logprobs.get(rid) for rid in req_ids]
        if runner_out.prompt_logprobs:
            out.prompt_logprobs = [runner_out.prompt_logprobs.get(rid) for rid in req_ids]
        if self._awaiting_first_output:
            hits = self._first_output_hits()
            if hits:
                out.num_cached_tokens = [hits.get(rid) for rid in req_ids]
        return out

    def _note_admitted(self, new_reqs: list[NewRequestData]) -> None:
        """Remember requests admitted for the first time (not resumed after a
        preemption), until their first output."""
        requests = self.scheduler.requests
        awaiting = self._awaiting_first_output
        for new in new_reqs:
            request = requests[new.req_id]
            if request.num_preemptions == 0:
                awaiting[new.req_id] = request

    def _first_output_hits(self) -> dict[int, int]:
        """Request id -> prompt tokens served from the prefix cache, for the
        requests whose first output is in this step. Runs only while some admitted
        request has no output yet, over those requests alone, so decode steps of
        requests past their first output pay nothing for it."""
        awaiting = self._awaiting_first_output
        hits = {}
        for rid, request in list(awaiting.items()):
            if request.num_tokens > request.num_prompt_tokens or (
                request.pooling is not None and request.status == RequestStatus.FINISHED_STOPPED
            ):
                hits[rid] = request.num_cached_prompt_tokens
                del awaiting[rid]
            elif request.is_finished:  # aborted or failed before its first token
                del awaiting[rid]
        return hits

    def stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache.pool.reset_prefix_cache()

    # -- tracing and profiling (asyncllm.tracing) --------------------------------

    def _set_recorder(self) -> None:
        """Give the step (and the model runner) a recorder while one of its jobs
        is on, and None otherwise."""
        profiling = self.profiler is not None and self.profiler.active
        rec = None
        if self.tracer is not None or self.step_timings is not None or profiling:
            rec = StepRecorder(self.tracer, self.step_timings, self.profiler)
        self.recorder = rec
        if not isinstance(self.runner, NullModelRunner):  # its spans: for traces only
            self.runner.recorder = rec if self.tracer is not None or profiling else None

    def start_profile(self) -> bool:
        """Start torch's profiler, with the step's phases as ranges, until
        `stop_profile` (or MAX_PROFILE_STEPS steps). Needs EngineArgs.profile_dir."""
        if self.profiler is None:
            raise ValueError("profiling is off: start the engine with a profile_dir")
        self.profiler.start()
        self._set_recorder()
        return True

    def stop_profile(self) -> dict[str, Any]:
        """Stop the profile and write its trace; returns its path and step count."""
        if self.profiler is None:
            raise ValueError("profiling is off: start the engine with a profile_dir")
        try:
            return self.profiler.stop()
        finally:
            self._set_recorder()

    def close(self) -> None:
        """Write the trace (if any) for the last time; stop tensor-parallel workers."""
        if self.tracer is not None:
            self.tracer.close()
        shutdown = getattr(self.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()


def build_engine_core(args: EngineArgs) -> EngineCore:
    """The core for `args`: its model config, and the EOS ids read from the model's
    and tokenizer's files (no tokenizer is loaded: the core knows token ids only)."""
    from asyncllm.models.hf_config import load_hf_config

    hf_config = load_hf_config(args.model)
    config = args.resolve(hf_config)
    eos = resolve_eos_token_ids(config.model, config.tokenizer, hf_config)
    return EngineCore(config, hf_config, eos)
