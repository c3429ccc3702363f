"""The model runner: turns a `SchedulerOutput` into one forward pass and samples.

Contract: `execute_model` is called once per step with the scheduler's plan and
returns the token sampled for every request whose known tokens are now all in the
KV cache (a request in the middle of a chunked prompt gets none). All per-step
inputs are gathered with vectorised numpy from the persistent `InputBatch`
(`step_inputs.py`); the only per-request Python work is bookkeeping for requests
that joined or left.

A step is a sequence of phases, one method each: prepare inputs, masks (the
grammar thread's, requested before the forward so they fill while it runs),
forward, prompt logprobs, logits, sample, outputs. The traced ones wear
`tracing.phase`, which costs one check while nothing is recorded.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Protocol

import numpy as np
import torch

from asyncllm import envs
from asyncllm.config import EngineConfig
from asyncllm.core.scheduler_output import SchedulerOutput
from asyncllm.lora.model import LoRAModel
from asyncllm.lora.ranks import AdapterFeed
from asyncllm.messages import Logprobs
from asyncllm.models import kernel_rows
from asyncllm.models.fused_decode import FusedDecode, unsupported
from asyncllm.models.loader import load_model
from asyncllm.models.native_ops import use_native_ops
from asyncllm.models.quant.as_gguf import as_gguf_linears
from asyncllm.structured_output.rows import GrammarRows, StepMasks
from asyncllm.tracing import StepRecorder, phase
from asyncllm.worker.gguf_select import select_gguf_kernels
from asyncllm.worker.in_flight import InFlightTokens
from asyncllm.worker.input_batch import InputBatch
from asyncllm.worker.kv_cache import allocate_kv_caches, num_kv_blocks_for
from asyncllm.worker.linear_select import select_linear_kernels
from asyncllm.worker.pooling import Pooler, PoolRows
from asyncllm.worker.prompt_logprobs import PromptLogprobsCollector
from asyncllm.worker.runner_output import ModelRunnerOutput
from asyncllm.worker.sampler import Sampler
from asyncllm.worker.sampler_output import SamplerOutput
from asyncllm.worker.sampling_metadata import build_sampling_metadata
from asyncllm.worker.spec_decode import Expansion, SpecDecoder, spec_logprobs
from asyncllm.worker.step_inputs import StepInputs, gather_step_inputs

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


class _Sample:
    """The requests a step samples: those whose known tokens are all computed."""

    __slots__ = ("req_ids", "rows", "last_token", "allowed")

    def __init__(self, step: StepInputs) -> None:
        done = step.sampled
        self.rows: np.ndarray = step.rows[done]
        self.req_ids: list[int] = (
            step.req_ids
            if len(self.rows) == step.num_reqs
            else [r for r, d in zip(step.req_ids, done.tolist(), strict=True) if d]
        )
        # each sampled request's last token among the step's tokens
        self.last_token: np.ndarray = (step.cu_query_lens - 1)[done]
        # the grammar masks it was sampled under (set by the sample phase)
        self.allowed: tuple[np.ndarray, np.ndarray] | None = None


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
        self.model = load_model(
            config.model, hf_config, config.torch_dtype, self.device, config.quantization
        )
        quant_kernel = envs.quant_kernel()
        if quant_kernel not in ("auto", "reference"):
            raise ValueError("ASYNCLLM_QUANT_KERNEL must be 'auto' or 'reference'")
        if quant_kernel == "auto" and self.device.type == "cpu" and tp is None:
            as_gguf_linears(self.model)  # int8 / int4 layers onto the GGUF kernels
        self.linear_kernels = select_linear_kernels(
            self.model,
            mode=config.linear_kernel,
            batch_invariant=config.batch_invariant,
            num_threads=torch.get_num_threads(),
            prefer_plain=config.fused_decode and unsupported(self.model) is None,
        )
        self.gguf_kernels = select_gguf_kernels(
            self.model,
            batch_invariant=config.batch_invariant,
            num_threads=torch.get_num_threads(),
            dtype=config.torch_dtype,
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
        else:
            use_native_ops(self.model)
        if config.fused_decode and tp is None:
            self.model.fused_decode = FusedDecode.build(
                self.model, self.kv_caches, torch.get_num_threads()
            )
        self.lora = (
            None if config.lora is None else LoRAModel.for_engine(self.model, config, self.device)
        )
        # tensor parallelism: the adapter reads, drops and slot writes the workers follow
        self._lora_feed = None if self.lora is None or tp is None else AdapterFeed(self.lora)
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
        # Speculative decoding's proposer and verifier (worker/spec_decode.py).
        self.spec = (
            None
            if config.speculative is None
            else SpecDecoder(config, self.num_blocks, self.vocab_size)
        )
        # Embedding requests: their rows are pooled instead of sampled.
        self.pooler = Pooler()
        # Set by the engine core: the matchers of constrained requests.
        self.grammar_rows: GrammarRows | None = None
        # Set by the engine core while tracing or profiling (asyncllm.tracing).
        self.recorder: StepRecorder | None = None

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """One step, as its phases: prepare inputs, masks, forward, logits,
        sample, outputs (each traced as a span when a recorder is set)."""
        step = self._prepare_inputs(so)
        if step is None:
            return ModelRunnerOutput()
        if self.spec is None:
            return self._run(so, step)
        start = time.perf_counter()
        decode_rows = _decode_rows(so, step)
        with kernel_rows.choose_by(decode_rows):
            out = self._run(so, step)
        if decode_rows:  # what verification costs: steps of decodes and drafts only
            seconds = time.perf_counter() - start
            self.spec.observe_step(decode_rows, step.num_tokens, seconds)
        return out

    def _run(self, so: SchedulerOutput, step: StepInputs) -> ModelRunnerOutput:
        """The phases after prepare_inputs."""
        pool = self.pooler.split(step)
        masks = self._request_masks(step)
        hidden = self._forward(step)
        out = ModelRunnerOutput()
        self._prompt_logprobs_of(step, hidden, out)
        if pool is not None:
            out.pooled = self._pool(step, pool, hidden)
        if not step.sampled.any():
            return out
        sample = _Sample(step)
        if self.spec is not None:
            self._verify(so, sample, hidden, masks, out)
            return out
        logits = self._logits(sample, hidden)
        result = self._sample(sample, logits, masks)
        self._outputs(sample, result, out)
        return out

    @phase("prepare_inputs")
    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs | None:
        """Apply the scheduler's changes to the input batch and gather the step's
        inputs; None for a step that runs nothing."""
        self._update_states(so)
        if so.is_empty:
            return None
        if so.spec_token_ids:
            assert self.spec is not None
            self.spec.write_drafts(self.input_batch, so.spec_token_ids)
        return gather_step_inputs(
            self.input_batch,
            so,
            self.block_size,
            self.device,
            self._pass_prompt_lens,
            token_wise=self.config.batch_invariant,
            prompt_runs=self.device.type == "cpu",
        )

    def _request_masks(self, step: StepInputs) -> StepMasks | None:
        """Ask the grammar thread for the constrained sampled rows' token masks: filled
        ahead, or while the model runs. None without constrained requests."""
        grammar = self.grammar_rows
        if grammar is None or not grammar.matchers:
            return None
        ids = [r for r, s in zip(step.req_ids, step.sampled.tolist(), strict=True) if s]
        return grammar.bitmask_async(ids) if ids else None

    @phase("forward", lambda step: {"batch": step.num_reqs, "tokens": step.num_tokens})
    def _forward(self, step: StepInputs) -> torch.Tensor:
        """The model's hidden states for every token (the workers run the same
        forward on their shards). On CUDA the span covers the launches; the wait
        shows in sampling."""
        ib = self.input_batch
        lora_slots = None if self.lora is None else self.lora.token_slots(step.token_rows)
        if self.tp is not None:
            feed = self._lora_feed
            self.tp.send_step(
                step.input_ids,
                step.positions,
                step.query_lens,
                step.context_lens,
                step.block_tables,
                step.slots,
                (step.cu_query_lens - 1)[step.sampled],
                bool((ib.num_prompt_logprobs[step.rows] >= 0).any()),
                lora_slots,
                None if feed is None else feed.take(),
            )
        input_ids = torch.from_numpy(step.input_ids.astype(np.int64)).to(self.device)
        self._in_flight.feed(input_ids, step.token_rows, step.positions)
        positions = torch.from_numpy(step.positions).to(self.device)
        if self.lora is not None:
            self.lora.begin_step(lora_slots)
        hidden: torch.Tensor = self.model(input_ids, positions, self.kv_caches, step.attention)
        return hidden

    def _prompt_logprobs_of(
        self, step: StepInputs, hidden: torch.Tensor, out: ModelRunnerOutput
    ) -> None:
        """Settle the last step's tokens (what follows reads them on the host), count
        this step's tokens as computed, and collect prompt logprobs where asked."""
        ib = self.input_batch
        # on a device this waits while this step's forward runs
        self._in_flight.settle(ib)
        ib.num_computed[step.rows] = step.seq_lens
        wanted = ib.num_prompt_logprobs[step.rows] >= 0
        if wanted.any():
            self._prompt_logprobs.collect(
                self.model,
                hidden,
                ib,
                step.rows,
                step.req_ids,
                step.context_lens,
                step.query_lens,
                step.cu_query_lens,
                wanted,
                out.prompt_logprobs,
            )
            if self.tp is not None:
                self.tp.end_logits()

    @phase("pool")
    def _pool(self, step: StepInputs, pool: PoolRows, hidden: torch.Tensor) -> dict[int, Any]:
        """The pooled hidden states of the embedding requests whose prompt ended."""
        num_prompt = self.input_batch.num_prompt_tokens[step.rows]
        return self.pooler.pool(step, pool, hidden, num_prompt)

    @phase("logits", lambda sample: {"batch": len(sample.req_ids)})
    def _logits(self, sample: _Sample, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of each sampled request's last token."""
        idx = torch.from_numpy(sample.last_token).to(self.device)
        logits: torch.Tensor = self.model.compute_logits(hidden[idx])
        return logits

    @phase("sample", lambda sample: {"batch": len(sample.req_ids)})
    def _sample(
        self, sample: _Sample, logits: torch.Tensor, masks: StepMasks | None
    ) -> SamplerOutput:
        """One sampler call for every sampled row, under its grammar's mask if any."""
        md = build_sampling_metadata(self.input_batch, sample.rows, self.vocab_size, self.device)
        if masks is not None:
            md.allowed = masks.result()
        sample.allowed = md.allowed
        return self.sampler(logits, md)

    @phase("outputs", lambda sample: {"batch": len(sample.req_ids)})
    def _outputs(self, sample: _Sample, result: SamplerOutput, out: ModelRunnerOutput) -> None:
        """Record the sampled tokens (the runner appends them itself: the next
        step's inputs come from here), advance the grammars, fill `out`."""
        ib = self.input_batch
        rows = sample.rows
        # the token itself lands in `token_ids` when it reaches the host
        nt = ib.num_tokens[rows]
        ib.num_tokens[rows] = nt + 1
        resolve = self._in_flight.put(
            result.sampled, result.nonfinite, rows, nt.astype(np.int64), sample.req_ids
        )
        if self._defer_tokens and sample.allowed is None:
            out.resolve = resolve
        else:
            # constrained rows advance their matchers now: the next step's masks
            # need the tokens on the host before its forward is queued
            out.sampled = resolve()
            self._in_flight.settle(ib)
            if sample.allowed is not None:
                assert self.grammar_rows is not None
                tokens = list(out.sampled.values())
                self.grammar_rows.advance(sample.req_ids, tokens, sample.allowed[0])
        if result.logprob_ids is not None:
            self._collect_logprobs(out, result, sample.req_ids, rows)

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
            row = ib.add(new)
            if new.pooling is not None:
                self.pooler.add(new.req_id, new.pooling)
            if self.lora is not None:
                self.lora.add_row(row, new.lora)
            if self.spec is not None:
                self.spec.add(ib, row, new)
            if grammar is not None and new.grammar is not None:
                grammar.add(new)

    def _remove(self, rid: int) -> None:
        row = self.input_batch.rows.get(rid)
        if row is not None:
            self.pooler.remove(rid)
            self._in_flight.drop(row)
            if self.lora is not None:
                self.lora.remove_row(row)
            self.input_batch.remove(rid)
            if self.spec is not None:
                self.spec.remove(row)

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

    # -- speculative decoding (worker/spec_decode.py) ---------------------------

    def _verify(
        self,
        so: SchedulerOutput,
        sample: _Sample,
        hidden: torch.Tensor,
        masks: StepMasks | None,
        out: ModelRunnerOutput,
    ) -> None:
        """The logits, sample, outputs phases of a speculative engine's step: every
        position of each request's drafts drawn in one sampler call, the drafts
        checked against the draws, then the next drafts proposed."""
        spec = so.spec_token_ids
        nd = np.fromiter(
            (len(spec.get(r, ())) for r in sample.req_ids), dtype=np.int64, count=len(sample.rows)
        )
        exp = Expansion(nd, sample.last_token, sample.rows)
        sample.last_token = exp.token_index
        logits = self._logits(sample, hidden)
        result = self._sample_drafts(sample, exp, logits, masks)
        self._verified_outputs(sample, exp, result, out)

    @phase("sample", lambda sample: {"batch": len(sample.req_ids)})
    def _sample_drafts(
        self, sample: _Sample, exp: Expansion, logits: torch.Tensor, masks: StepMasks | None
    ) -> SamplerOutput:
        """One sampler call for every position of every sampled request."""
        md = build_sampling_metadata(
            self.input_batch, exp.rows, self.vocab_size, self.device, offsets=exp.offsets
        )
        if masks is not None:  # constrained requests have no drafts: one row each
            idx, bitmask = masks.result()
            sample.allowed = (idx, bitmask)
            md.allowed = (exp.start[idx], bitmask)
        return self.sampler(logits, md)

    @phase("verify", lambda sample: {"batch": len(sample.req_ids)})
    def _verified_outputs(
        self, sample: _Sample, exp: Expansion, result: SamplerOutput, out: ModelRunnerOutput
    ) -> None:
        """Accept the drafts the draws confirm, record the kept tokens in the
        batch, roll back the rejected drafts, propose the next ones, fill `out`."""
        assert self.spec is not None
        ib = self.input_batch
        rows = sample.rows
        if result.nonfinite is not None and result.nonfinite.any():
            logger.warning("logits of sampled rows have no finite maximum: each sampled its argmax")
        num_accepted, tokens = self.spec.verify(exp, result.sampled.cpu().numpy(), ib, rows)
        nt = ib.num_tokens[rows]
        verified: dict[int, list[int]] = {}
        for i, rid in enumerate(sample.req_ids):
            toks = tokens[i]
            ib.token_ids[rows[i], nt[i] : nt[i] + len(toks)] = toks
            if exp.num_drafts[i]:
                verified[rid] = toks
            else:
                out.sampled[rid] = toks[0]
        ib.num_tokens[rows] = nt + num_accepted + 1
        ib.num_computed[rows] -= (exp.num_drafts - num_accepted).astype(np.int32)
        out.verified = verified
        if sample.allowed is not None:
            assert self.grammar_rows is not None
            self.grammar_rows.advance(sample.req_ids, [t[0] for t in tokens], sample.allowed[0])
        if result.logprob_ids is not None:
            wanted = ib.num_logprobs[rows].tolist()
            out.logprobs = spec_logprobs(result, exp, tokens, wanted, sample.req_ids)
        room = ib.max_model_len - ib.num_tokens[rows].astype(np.int64) - 1
        out.drafts = self._propose(rows, sample.req_ids, tokens, exp.num_drafts, num_accepted, room)

    @phase("propose", lambda rows: {"batch": len(rows)})
    def _propose(
        self,
        rows: np.ndarray,
        req_ids: list[int],
        tokens: list[list[int]],
        num_drafts: np.ndarray,
        num_accepted: np.ndarray,
        room: np.ndarray,
    ) -> dict[int, list[int]]:
        assert self.spec is not None
        ib = self.input_batch
        return self.spec.propose(ib, rows, req_ids, tokens, num_drafts, num_accepted, room)


def _decode_rows(so: SchedulerOutput, step: StepInputs) -> int:
    """For a step whose every request brings one token and its drafts (a
    verification standing for decode steps), the decode step's rows; else 0.
    `kernel_rows` says why."""
    spec = so.spec_token_ids
    for rid, n in zip(step.req_ids, step.query_lens.tolist(), strict=True):
        if n != 1 + len(spec.get(rid, ())):
            return 0
    return step.num_reqs
