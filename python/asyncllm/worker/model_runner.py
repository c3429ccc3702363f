"""The model runner: turns a `SchedulerOutput` into one forward pass and samples.

Contract: `execute_model` is called once per step with the scheduler's plan and
returns the token sampled for every request whose known tokens are now all in the
KV cache (a request in the middle of a chunked prompt gets none). All per-step
inputs are gathered with vectorised numpy from the persistent `InputBatch`; the
only per-request Python work is bookkeeping for requests that joined or left.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np
import torch

from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.messages import Logprobs
from asyncllm.models.attention import build_attention_metadata
from asyncllm.models.loader import load_model
from asyncllm.tracing import StepRecorder
from asyncllm.worker.in_flight import InFlightTokens
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.kv_cache import allocate_kv_caches, num_kv_blocks_for
from asyncllm.worker.linear_select import select_linear_kernels
from asyncllm.worker.prompt_logprobs import PromptLogprobsCollector
from asyncllm.worker.runner_output import ModelRunnerOutput
from asyncllm.worker.sampler import Sampler
from asyncllm.worker.sampling_metadata import build_sampling_metadata
from asyncllm.worker.structured import GrammarRows

logger = logging.getLogger(__name__)


class TensorParallelDriver(Protocol):
    """Rank 0's side of tensor parallelism (asyncllm.executor.abstract.TPExecutor)."""

    def join(self, num_blocks: int) -> int:
        """After this rank's shard is loaded: wait for the other ranks and return
        the KV block count every rank can hold."""

    def wrap(self, model: Any) -> None:
        """Let the model's extra `compute_logits` calls reach the workers."""

    def send_step(self, *inputs: Any) -> None:
        """This step's model inputs, to every worker (see executor/step_channel.py)."""

    def end_logits(self) -> None:
        """After a step's prompt-logprobs `compute_logits` calls."""


class ModelRunner:
    def __init__(
        self, config: EngineConfig, hf_config: Any, tp: TensorParallelDriver | None = None
    ) -> None:
        self.config = config
        self.device = config.torch_device
        self.block_size = config.block_size
        torch.manual_seed(config.seed)
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model = load_model(config.model, hf_config, config.torch_dtype, self.device)
        self.linear_kernels = select_linear_kernels(
            self.model,
            mode=config.linear_kernel,
            batch_invariant=config.batch_invariant,
            num_threads=torch.get_num_threads(),
        )
        # Phi-3's longrope rotates a whole sequence by its prompt's length.
        self._pass_prompt_lens = bool(getattr(self.model, "uses_prompt_lens", False))
        self.vocab_size = int(self.model.vocab_size)
        self.num_blocks = num_kv_blocks_for(config, self.model)
        # Tensor parallelism: this is rank 0, and the workers mirror each forward pass.
        self.tp = tp
        if tp is not None:
            self.num_blocks = tp.join(self.num_blocks)
            tp.wrap(self.model)
        self.kv_caches = allocate_kv_caches(config, self.model, self.num_blocks)
        if config.compile:
            from asyncllm.worker.compile import compile_model

            compile_model(self.model, self.kv_caches, config.block_size)
        max_blocks_per_req = -(-config.max_model_len // config.block_size)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, max_blocks_per_req)
        # Draws are keyed by (seed, output position), so a resumed request goes on
        # where it was without keeping any generator state.
        self.sampler = Sampler(config.seed)
        # sampled tokens on their way to the host; with overlap scheduling the
        # next step takes them from the device and the busy loop waits for them
        self._in_flight = InFlightTokens(config.max_num_seqs, self.device)
        self._defer_tokens = config.async_scheduling
        self._prompt_logprobs = PromptLogprobsCollector(self.vocab_size)
        # Set by the engine core: the matchers of constrained requests.
        self.grammar_rows: GrammarRows | None = None
        # Set by the engine core while tracing or profiling (asyncllm.tracing).
        self.recorder: StepRecorder | None = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        ib = self.input_batch
        rec = self.recorder
        if rec is not None:
            t = rec.begin("prepare_inputs")
        self._update_states(so)
        if so.is_empty:
            if rec is not None:
                rec.end("prepare_inputs", t)
            return ModelRunnerOutput()

        req_ids = list(so.num_scheduled_tokens)
        n = len(req_ids)
        q = np.fromiter(so.num_scheduled_tokens.values(), dtype=np.int32, count=n)
        rows = np.fromiter((ib.rows[r] for r in req_ids), dtype=np.int64, count=n)
        if not (q == 1).all():
            # attention takes the 1-token queries (decodes) first
            order = np.argsort(q != 1, kind="stable")
            q, rows = q[order], rows[order]
            req_ids = [req_ids[i] for i in order]
        ctx = ib.num_computed[rows]
        seq_lens = ctx + q
        cu = np.cumsum(q)
        total = int(cu[-1])
        bs = self.block_size
        if total == n:  # decode-only step: one token per request
            tok_rows, pos = rows, ctx.astype(np.int64)
        else:
            tok_rows = np.repeat(rows, q)
            pos = np.arange(total, dtype=np.int64) + np.repeat(ctx - (cu - q), q)
        input_ids = ib.token_ids[tok_rows, pos]
        slots = ib.block_table[tok_rows, pos // bs].astype(np.int64) * bs + pos % bs
        max_nb = int((seq_lens.max() + bs - 1) // bs)
        prompt_lens = ib.num_prompt_tokens[rows] if self._pass_prompt_lens else None
        meta = build_attention_metadata(
            q, ctx, ib.block_table[rows, :max_nb], slots, bs, self.device, prompt_lens
        )
        grammar = self.grammar_rows
        masks = None
        if grammar is not None and grammar.matchers:
            # the rows sampled this step (as `done` below): their masks were filled
            # ahead on the grammar thread, or are filled there while the model runs
            sampling = (seq_lens == ib.num_tokens[rows]).tolist()
            ids = [r for r, d in zip(req_ids, sampling, strict=True) if d]
            masks = grammar.bitmask_async(ids) if ids else None
        tp = self.tp
        if tp is not None:
            tp.send_step(
                input_ids,
                pos,
                q,
                ctx,
                ib.block_table[rows, :max_nb],
                slots,
                (cu - 1)[seq_lens == ib.num_tokens[rows]],
                bool((ib.num_prompt_logprobs[rows] >= 0).any()),
            )
        input_ids_t = torch.from_numpy(input_ids.astype(np.int64)).to(self.device)
        self._in_flight.feed(input_ids_t, tok_rows, pos)
        pos_t = torch.from_numpy(pos).to(self.device)
        if rec is not None:
            t = rec.phase("prepare_inputs", t, "forward")
        hidden = self.model(input_ids_t, pos_t, self.kv_caches, meta)
        if rec is not None:  # on CUDA: the launches; the wait shows in sampling
            rec.end("forward", t, {"batch": n, "tokens": total})
        # the last step's tokens, for what reads them on the host below (penalties,
        # prompt logprobs); on a device this waits while this step's forward runs
        self._in_flight.settle(ib)

        done = seq_lens == ib.num_tokens[rows]  # all known tokens computed: sample
        ib.num_computed[rows] = seq_lens
        out = ModelRunnerOutput()
        plp_rows = ib.num_prompt_logprobs[rows] >= 0
        if plp_rows.any():
            self._prompt_logprobs.collect(
                self.model, hidden, ib, rows, req_ids, ctx, q, cu, plp_rows, out.prompt_logprobs
            )
            if tp is not None:
                tp.end_logits()
        if not done.any():
            return out
        if rec is not None:
            t = rec.begin("sampling")
        sample_rows = rows[done]
        done_ids = (
            [r for r, d in zip(req_ids, done.tolist(), strict=True) if d]
            if n != len(sample_rows)
            else req_ids
        )
        idx = torch.from_numpy((cu - 1)[done]).to(self.device)
        logits = self.model.compute_logits(hidden[idx])
        md = build_sampling_metadata(ib, sample_rows, self.vocab_size, self.device)
        if masks is not None:
            md.allowed = masks.result()
        result = self.sampler(logits, md)
        # the runner appends sampled tokens itself: the next step's inputs come
        # from here (the token itself lands in `token_ids` when it reaches the host)
        nt = ib.num_tokens[sample_rows]
        ib.num_tokens[sample_rows] = nt + 1
        resolve = self._in_flight.put(
            result.sampled, result.nonfinite, sample_rows, nt.astype(np.int64), done_ids
        )
        if self._defer_tokens and md.allowed is None:
            out.resolve = resolve
        else:
            # constrained rows advance their matchers now: the next step's masks
            # need the tokens on the host before its forward is queued
            out.sampled = resolve()
            self._in_flight.settle(ib)
            if md.allowed is not None:
                sampled = list(out.sampled.values())
                grammar.advance(done_ids, sampled, md.allowed[0])  # type: ignore[union-attr]
        if result.logprob_ids is not None:
            self._collect_logprobs(out, result, done_ids, sample_rows)
        if rec is not None:
            rec.end("sampling", t, {"batch": len(done_ids)})
        return out

    def _update_states(self, so: SchedulerOutput) -> None:
        ib = self.input_batch
        grammar = self.grammar_rows
        for rid in so.finished_req_ids:
            self._remove(rid)
            self._prompt_logprobs.drop(rid)
            if grammar is not None:
                grammar.remove(rid)
        for rid in so.preempted_req_ids:
            self._remove(rid)
            if grammar is not None:
                grammar.remove(rid)
        for rid, block_ids in so.new_block_ids.items():
            ib.append_blocks(rid, block_ids)
        for new in so.new_reqs:
            ib.add(new)
            if grammar is not None and new.grammar is not None:
                grammar.add(new)

    def _remove(self, rid: int) -> None:
        row = self.input_batch.rows.get(rid)
        if row is not None:
            self._in_flight.drop(row)
            self.input_batch.remove(rid)

    def _collect_logprobs(
        self, out: ModelRunnerOutput, result: Any, req_ids: list[int], rows: np.ndarray
    ) -> None:
        wanted = self.input_batch.num_logprobs[rows]
        ids = result.logprob_ids.tolist()
        values = result.logprob_values.tolist()
        ranks = result.logprob_ranks.tolist()
        for i, rid in enumerate(req_ids):
            k = int(wanted[i])
            if k >= 0:
                out.logprobs[rid] = Logprobs(ids[i][: k + 1], values[i][: k + 1], [ranks[i]])
