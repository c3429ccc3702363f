"""The scheduler: one token budget per step, shared by decodes and prompt chunks.

Each step, running requests get their next token first (a decode, or the next
chunk of a prompt that did not fit before); waiting requests then get prompt
tokens with what is left of `max_num_batched_tokens` and `max_num_seqs`. When the
KV pool runs dry the most recently admitted running request is preempted: its
blocks are freed and it is recomputed later (its own blocks often come back from
the prefix cache). With overlap scheduling, `AsyncScheduler` (core.async_scheduler)
plans a step while the previous one runs, counting each in-flight token as a
placeholder (`Request.num_output_placeholders`, always 0 here).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from asyncllm._core import SchedulerStats
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.queue_time import QueueTimeHistogram
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler_output import NewRequestData, SchedulerOutput
from asyncllm.core.spec_decode import SpecDecodeStats, apply_verified, fit_drafts


class _Plan:
    """The step's plan while `schedule` builds it."""

    __slots__ = ("budget", "num_scheduled", "new_block_ids", "new_reqs", "preempted", "spec")

    def __init__(self, budget: int) -> None:
        self.budget = budget  # tokens left this step
        self.num_scheduled: dict[int, int] = {}
        self.new_block_ids: dict[int, list[int]] = {}
        self.new_reqs: list[NewRequestData] = []
        self.preempted: set[int] = set()
        self.spec: dict[int, list[int]] = {}  # drafts verified this step


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_speculative_tokens: int = 0,
        max_loras: int = 0,
    ) -> None:
        self.kv_cache = kv_cache
        # LoRA: at most this many distinct adapters among running requests (the
        # runner's device slots); 0 when LoRA is off
        self.max_loras = max_loras
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.requests: dict[int, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.queue_time = QueueTimeHistogram()
        # Requests that left since the last schedule(); the runner drops them.
        self._finished_ids: set[int] = set()
        # True when every running request has exactly one token to compute (its
        # last sampled one): the next step is all decodes, so `schedule` can skip
        # the per-request allocation arithmetic. Set by `update_from_output`.
        self._all_decode = False
        self._all_running_scheduled = False
        # Sliding window: a prompt chunk that does not fit runs in part (the blocks it
        # leaves behind the window come back before the next part).
        self._windowed = kv_cache.sliding_window is not None
        # Speculative decoding: acceptance counters, and how many tokens each
        # request that verified drafts appended in the last step (others: one).
        # Its steps never take the all-decode fast path: a request may hold a
        # block past its computed tokens (its rejected drafts' slots).
        self.spec_stats = (
            SpecDecodeStats(num_speculative_tokens) if num_speculative_tokens else None
        )
        self.num_appended: dict[int, int] = {}

    # -- admission and removal ------------------------------------------------

    def id_in_use(self, request_id: int) -> bool:
        """Whether a new request may not take this id now (it is unfinished)."""
        return request_id in self.requests

    def add_request(self, request: Request) -> None:
        if self.id_in_use(request.request_id):
            raise ValueError(f"request id {request.request_id!r} is already in the engine")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[int], status: RequestStatus) -> list[Request]:
        """Abort (or otherwise finish) requests from outside the step; their blocks
        are freed at once. Unknown or already finished ids are ignored."""
        finished = []
        for rid in request_ids:
            request = self.requests.get(rid)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request)
            finished.append(request)
        return finished

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- the step -------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step's plan: running requests first (oldest first; the newest
        are preempted when blocks run out), then waiting ones in order while the
        token budget, the seats and the blocks last, unless this step preempted."""
        plan = _Plan(self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        finished, self._finished_ids = self._finished_ids, set()
        return SchedulerOutput(
            new_reqs=plan.new_reqs,
            new_block_ids=plan.new_block_ids,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            finished_req_ids=finished,
            preempted_req_ids=plan.preempted,
            spec_token_ids=plan.spec,
        )

    def _schedule_all_decodes(self, plan: _Plan) -> bool:
        """Fast path, when every running request decodes one token: only requests
        whose computed tokens fill their blocks exactly need a block (a block table
        holds exactly ceil(num_computed_tokens / block_size) blocks after every
        step). False when it does not apply or the blocks are not there."""
        running = self.running
        if not self._all_decode or len(running) > plan.budget:
            return False
        kv = self.kv_cache
        bs = kv.block_size
        live = self._decodes(running)
        need = [r for r in live if not r.num_computed_tokens % bs]
        added_ids = kv.allocate_decode_blocks(need) if need else {}
        if added_ids is None:
            return False
        plan.new_block_ids = added_ids
        plan.num_scheduled = dict.fromkeys([r.request_id for r in live], 1)
        plan.budget -= len(live)
        return True

    def _schedule_running(self, plan: _Plan) -> None:
        """Each running request's next tokens (a prompt chunk or one decode),
        preempting the newest requests when the blocks run out."""
        running = self.running
        if self._schedule_all_decodes(plan):
            self._all_running_scheduled = True
            return
        kv = self.kv_cache
        windowed = self._windowed
        budget = plan.budget
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            known = request.num_tokens + request.num_output_placeholders
            if known >= request.max_num_tokens:
                i += 1  # overlap: its last token is in flight, nothing left to compute
                continue
            num_new = min(known - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                drafts = fit_drafts(request, drafts, num_new, budget)
                num_new += len(drafts)
            while True:
                added = kv.allocate(request, num_new)
                if added is not None:
                    break
                if windowed and num_new > 1:  # a shorter prompt chunk may fit
                    fit = kv.fit_tokens(request, num_new)
                    if 0 < fit < num_new:
                        num_new = fit
                        continue
                victim = running.pop()
                self._preempt(victim)
                plan.preempted.add(victim.request_id)
                plan.num_scheduled.pop(victim.request_id, None)
                plan.spec.pop(victim.request_id, None)
                if victim is request:
                    break
            if added is None:
                break  # the request preempted itself: nothing left to run it with
            if added:
                plan.new_block_ids[request.request_id] = [b.block_id for b in added]
            plan.num_scheduled[request.request_id] = num_new
            if drafts:
                plan.spec[request.request_id] = drafts
            budget -= num_new
            i += 1
        plan.budget = budget
        self._all_running_scheduled = i == len(running)

    def _schedule_waiting(self, plan: _Plan) -> None:
        """Admit waiting requests in order while budget, seats and blocks last,
        reusing their cached prefix blocks."""
        kv = self.kv_cache
        windowed = self._windowed
        waiting = self.waiting
        running = self.running
        adapters: set[Any] | None = None  # LoRA: the running requests' adapters
        skipped: list[Request] = []  # waiting for an adapter slot, kept in order
        while waiting and plan.budget > 0 and len(running) < self.max_num_seqs:
            request = waiting[0]
            if request.lora is not None and self.max_loras:
                if adapters is None:
                    adapters = {r.lora for r in running if r.lora is not None}
                if request.lora not in adapters and len(adapters) >= self.max_loras:
                    skipped.append(waiting.popleft())
                    continue
                adapters.add(request.lora)
            computed, num_cached = (
                kv.get_computed_blocks(request) if request.num_computed_tokens == 0 else ([], 0)
            )
            num_new = min(request.num_tokens - num_cached, plan.budget)
            added = kv.allocate(request, num_new, computed)
            if added is None and windowed:  # the part of the prompt that fits
                num_new = kv.fit_tokens(request, num_new, computed)
                added = kv.allocate(request, num_new, computed) if num_new else None
            if added is None:
                break
            waiting.popleft()
            self._admit(request, num_cached)
            plan.num_scheduled[request.request_id] = num_new
            plan.budget -= num_new
            plan.new_reqs.append(self._new_request_data(request, num_cached))
        waiting.extendleft(reversed(skipped))

    def _admit(self, request: Request, num_cached: int) -> None:
        """A waiting request starts running with `num_cached` prompt tokens cached;
        its queue time is observed at its first admission only."""
        request.num_computed_tokens = num_cached
        if request.num_preemptions == 0:
            request.num_cached_prompt_tokens = num_cached
            if request.arrival_time > 0:
                self.queue_time.observe(time.time() - request.arrival_time)
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def _new_request_data(self, request: Request, num_cached: int) -> NewRequestData:
        """What the runner needs of a request it has not seen (or saw preempted)."""
        rid = request.request_id
        return NewRequestData(
            req_id=rid,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            block_ids=self.kv_cache.block_ids(rid),
            num_computed_tokens=num_cached,
            stop_token_ids=request.stop_token_ids,
            grammar=request.grammar,
            pooling=request.pooling,
            lora=request.lora,
        )

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[int, int],
        verified: dict[int, list[int]] | None = None,
        pooled: dict[int, object] | None = None,
    ) -> tuple[list[Request], bool]:
        """Advance every scheduled request by its computed tokens, append the
        sampled token of those that were sampled (`verified`: the tokens of those
        that verified drafts, `spec_decode.apply_verified`), and finish the ones
        that must stop, and the embedding requests the runner pooled (`pooled`).
        Returns the requests that produced a token or an embedding this step
        (finished or not), in batch order, and whether any of them finished."""
        kv = self.kv_cache
        requests = self.requests
        bs = kv.block_size
        caching = kv.enable_caching
        cache_blocks = kv.cache_blocks
        stepped: list[Request] = []
        append = stepped.append
        finished = False
        num_unsampled = 0
        # The one per-request loop of the step: keep it to attribute reads, and
        # call out only when a block fills or a stop is possible.
        for rid, num in scheduler_output.num_scheduled_tokens.items():
            request = requests.get(rid)
            if request is None:
                continue  # aborted after scheduling
            computed = request.num_computed_tokens = request.num_computed_tokens + num
            if caching and (num > 1 or not computed % bs):
                cache_blocks(request)  # a block filled: share it through the prefix cache
            token = sampled.get(rid)
            if token is None:
                if verified and rid in verified:
                    finished |= self._apply_verified(request, scheduler_output, verified[rid])
                    append(request)
                    continue
                if pooled and rid in pooled:  # an embedding request, done with its prompt
                    request.status = RequestStatus.FINISHED_STOPPED
                    finished = True
                    append(request)
                    continue
                num_unsampled += 1
                continue  # mid-prompt chunk: nothing sampled yet
            tokens = request.all_token_ids
            tokens.append(token)
            n = len(tokens)
            if not n % bs and request.block_hashes is not None:
                request.hash_full_blocks()
            if (n >= request.max_num_tokens or token in request.stop_token_ids) and (
                request.check_stop(token)
            ):
                finished = True
            append(request)
        if finished:
            self._drop_finished(stepped)
        self._all_decode = (
            self._all_running_scheduled and num_unsampled == 0 and self.spec_stats is None
        )
        return stepped, finished

    def _apply_verified(self, request: Request, so: SchedulerOutput, tokens: list[int]) -> bool:
        """A request that verified drafts: roll back the rejected ones, append its
        tokens (`num_appended`); whether it finished."""
        assert self.spec_stats is not None
        num_drafts = len(so.spec_token_ids.get(request.request_id, ()))
        appended, finished = apply_verified(request, num_drafts, tokens, self.spec_stats)
        self.num_appended[request.request_id] = appended
        if self.kv_cache.enable_caching and not finished:
            self.kv_cache.cache_blocks(request)  # blocks its accepted tokens filled
        return finished

    def set_drafts(self, drafts: dict[int, list[int]]) -> None:
        """The draft tokens proposed after the last step, for the next one to
        verify; requests that finished meanwhile are skipped."""
        requests = self.requests
        for rid, tokens in drafts.items():
            request = requests.get(rid)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.spec_token_ids = tokens

    def _drop_finished(self, stepped: list[Request], from_waiting: bool = False) -> None:
        """Take the requests that just finished out of the queues (one pass, not a
        list.remove each: many may finish in one step) and free their blocks."""
        self.running = [r for r in self.running if not r.is_finished]
        if from_waiting:  # preempted after the step was planned (overlap scheduling)
            self.waiting = type(self.waiting)(r for r in self.waiting if not r.is_finished)
        for request in stepped:
            if request.is_finished:
                self._free(request)

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    # -- internals ------------------------------------------------------------

    def _decodes(self, running: list[Request]) -> list[Request]:
        """The running requests the all-decode fast path schedules: all of them
        (the overlap scheduler leaves out those whose last token is in flight)."""
        return running

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _free(self, request: Request) -> None:
        self.kv_cache.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
