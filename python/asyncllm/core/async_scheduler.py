"""The scheduler for overlap ("async") scheduling: it plans step N+1 while step N
is still running, before N's sampled tokens are known.

Each request's token that a scheduled step will sample counts as computed but
unknown (`Request.num_output_placeholders`, as vLLM's placeholders): `schedule`
advances `num_computed_tokens` at once and adds a placeholder for every request
the step samples, so the next plan gives each running decode its next position;
the runner, which executes the steps in order, puts the real token there itself.
`update_from_output` then only appends the sampled tokens and applies stops. A
request that stops at step N may already be in step N+1: it is freed at N's
update, and its token from N+1 is dropped (it is no longer in `requests`).

Blocks are registered in the prefix cache when their step is scheduled (their
tokens are known; the steps run in order, so a later request that shares them
reads them after they are written), which keeps what each plan can hit the same
as in serial mode, where they are registered after the step ran.
"""

from __future__ import annotations

from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request import Request, RequestStatus
from asyncllm.core.scheduler import Scheduler
from asyncllm.core.scheduler_output import SchedulerOutput


class AsyncScheduler(Scheduler):
    def __init__(self, kv_cache: KVCacheManager, **limits: int) -> None:
        super().__init__(kv_cache, **limits)
        # The latest plan's scheduled tokens until its update: the step in flight.
        self._planned: dict[int, int] = {}

    def id_in_use(self, request_id: int) -> bool:
        # A request that ended while in the step in flight: a new request under
        # its id would receive that step's token for it.
        return request_id in self.requests or (
            request_id in self._planned and request_id in self._finished_ids
        )

    def schedule(self) -> SchedulerOutput:
        so = super().schedule()
        self._planned = so.num_scheduled_tokens
        requests = self.requests
        kv = self.kv_cache
        bs = kv.block_size
        caching = kv.enable_caching
        cache_blocks = kv.cache_blocks
        num_unsampled = 0
        for rid, num in so.num_scheduled_tokens.items():
            request = requests[rid]
            computed = request.num_computed_tokens = request.num_computed_tokens + num
            if caching and (num > 1 or not computed % bs):
                cache_blocks(request)
            if computed == request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
            else:
                num_unsampled += 1  # mid-prompt chunk
        # Every running request has exactly one token to compute at the next plan
        # (those left out now end at the update before it: their last token is in
        # flight).
        self._all_decode = self._all_running_scheduled and num_unsampled == 0
        return so

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        sampled: dict[int, int],
        verified: dict[int, list[int]] | None = None,
        pooled: dict[int, object] | None = None,
    ) -> tuple[list[Request], bool]:
        """Append the tokens step N sampled (its requests' progress was counted
        when it was scheduled) and finish the ones that must stop. Returns the
        requests that produced a token, and whether any finished. (`verified` is
        always empty: speculative decoding runs without overlap, config.py.) An
        embedding request's last chunk counted a placeholder at `schedule`, which
        keeps it out of later plans until `pooled` finishes it here."""
        if scheduler_output.num_scheduled_tokens is self._planned:
            self._planned = {}
        kv = self.kv_cache
        requests = self.requests
        bs = kv.block_size
        caching = kv.enable_caching
        stepped: list[Request] = []
        append = stepped.append
        finished = False
        finished_waiting = False
        running = RequestStatus.RUNNING
        for rid, token in sampled.items():
            request = requests.get(rid)
            if request is None:
                continue  # it ended after this step was scheduled: drop the token
            request.num_output_placeholders -= 1
            tokens = request.all_token_ids
            tokens.append(token)
            n = len(tokens)
            if not n % bs and request.block_hashes is not None:
                request.hash_full_blocks()
                if caching and request.status == running:
                    kv.cache_blocks(request)  # the block may be computed already
            if n >= request.max_num_tokens or token in request.stop_token_ids:
                was_waiting = request.status != running  # preempted after scheduling
                if request.check_stop(token):
                    finished = True
                    finished_waiting |= was_waiting
            append(request)
        if pooled:
            finished_waiting |= self._finish_pooled(pooled, stepped)
            finished = True
        if finished:
            self._drop_finished(stepped, from_waiting=finished_waiting)
        return stepped, finished

    def _finish_pooled(self, pooled: dict[int, object], stepped: list[Request]) -> bool:
        """Finish the embedding requests pooled in the step (those still here);
        whether one of them had been preempted since it was planned."""
        from_waiting = False
        for rid in pooled:
            request = self.requests.get(rid)
            if request is None:
                continue
            request.num_output_placeholders = 0
            from_waiting |= request.status != RequestStatus.RUNNING
            request.status = RequestStatus.FINISHED_STOPPED
            stepped.append(request)
        return from_waiting

    def _decodes(self, running: list[Request]) -> list[Request]:
        # An all-decode request has computed every known token but its in-flight
        # one; the ones whose in-flight token is their last have nothing to run.
        return [r for r in running if r.num_computed_tokens + 1 < r.max_num_tokens]
