"""bfloat16 as a first-class dtype: our bf16 model over a bf16 (or float32) paged KV
cache against transformers' bf16 forward, and the engine's greedy ids against
transformers' greedy choice on the same prefixes.

Tolerances, stated: bf16 keeps 8 mantissa bits, and the two implementations round
at different places (fused QKV, attention in float32 in our kernel), so logits may
differ by a few bf16 ulps of the activations: we ask for max |ours - theirs| within
10 % of the logits' spread (std; measured: up to ~5.5 %) and a mean difference within
2 % (measured: up to ~1 %, the torch path's bf16 SDPA). Greedy ids must
match transformers' argmax on at least 95 % of positions (the issue's bar); the
measured figure is printed (`-s`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_models import SCHEDULE, PagedDriver
from transformers import AutoModelForCausalLM

from asyncllm import LLM, SamplingParams
from asyncllm.models import attention
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
from tiny_models import make_tiny_model

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("bf16"), arch="llama", tokenizer="llama-2")


def _hf(model_dir: Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation="eager"
    ).eval()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kernel", [True, False], ids=["rust-kernel", "torch-path"])
def test_bf16_logits_match_transformers_bf16(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch, kv_dtype: torch.dtype, kernel: bool
) -> None:
    if not kernel:
        monkeypatch.setattr(attention, "can_use_native_decode", lambda q, kv_cache: False)
    hf_config = load_hf_config(model_dir)
    ours = load_model(model_dir, hf_config, torch.bfloat16, CPU)
    ref = _hf(model_dir)
    lengths = [0, 0, 0]
    for step in SCHEDULE:
        for seq, n in step:
            lengths[seq] += n
    gen = torch.Generator().manual_seed(1)
    tokens = [torch.randint(0, hf_config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    with torch.no_grad():
        expected = [ref(torch.tensor([t])).logits[0].float() for t in tokens]
    driver = PagedDriver(ours)
    driver.kv_caches = [c.to(kv_dtype) for c in driver.kv_caches]
    done = [0, 0, 0]
    worst = mean = 0.0
    for work in SCHEDULE:
        for (seq, n), logits in zip(work, driver.step(tokens, work), strict=True):
            want = expected[seq][done[seq] : done[seq] + n]
            assert logits.dtype == torch.float32  # sampling reads float32
            spread = want.std().item()
            diff = (logits - want).abs()
            assert diff.max().item() <= 0.10 * spread, (diff.max().item(), spread)
            assert diff.mean().item() <= 0.02 * spread, (diff.mean().item(), spread)
            done[seq] += n
            worst = max(worst, diff.max().item() / spread)
            mean = max(mean, diff.mean().item() / spread)
    print(f"bf16 logits vs transformers bf16: max {worst:.3%}, mean {mean:.3%} of std")


@pytest.mark.parametrize(
    ("dtype", "kv_cache_dtype"),
    [("bfloat16", "auto"), ("float32", "bfloat16"), ("bfloat16", "float32")],
)
def test_engine_greedy_ids_match_transformers(
    model_dir: Path, dtype: str, kv_cache_dtype: str
) -> None:
    """The engine (decodes on the Rust kernel) generates greedy continuations;
    transformers' argmax in the model's dtype on each prefix agrees on >= 95 %."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 32000, (n,), generator=g).tolist() for n in (5, 17, 40, 64)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    engine = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    with LLM(str(model_dir), multiprocess=False, **engine) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    ref = _hf(model_dir, getattr(torch, dtype))
    agree = total = 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outs, strict=True):
            ids = list(out.outputs[0].token_ids)
            assert len(ids) == 24
            logits = ref(torch.tensor([prompt + ids])).logits[0]
            choice = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
            agree += sum(a == b for a, b in zip(choice, ids, strict=True))
            total += len(ids)
    print(f"{engine}: greedy ids equal to transformers' {dtype} argmax: {agree}/{total}")
    assert agree >= 0.95 * total


def test_lm_head_runs_only_for_sampled_rows_in_the_model_dtype(model_dir: Path) -> None:
    """A prefill chunk that does not end its prompt gets no LM-head row; the head
    runs on the model's dtype (bf16) hidden states and hands float32 to the sampler."""
    from asyncllm import EngineArgs
    from asyncllm.core.scheduler_output import NewRequestData, SchedulerOutput
    from asyncllm.worker.model_runner import ModelRunner

    hf = load_hf_config(model_dir)
    args = EngineArgs(model=str(model_dir), dtype="bfloat16", device="cpu", num_kv_blocks=64)
    runner = ModelRunner(args.resolve(hf), hf)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    calls: list[tuple[int, torch.dtype, torch.dtype]] = []
    head = runner.model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits = head(hidden)
        calls.append((hidden.shape[0], hidden.dtype, logits.dtype))
        return logits

    runner.model.compute_logits = spy  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    long = NewRequestData(0, list(range(3, 43)), 40, params, [0, 1, 2], 0, frozenset())
    short = NewRequestData(1, list(range(5, 13)), 8, params, [3], 0, frozenset())
    out = runner.execute_model(SchedulerOutput([long, short], {}, {0: 16, 1: 8}, 24)).resolved()
    assert set(out.sampled) == {1}  # the 16-token chunk of 40 samples nothing
    assert calls == [(1, torch.bfloat16, torch.float32)]
    out = runner.execute_model(SchedulerOutput([], {}, {1: 1, 0: 24}, 25)).resolved()
    assert set(out.sampled) == {0, 1}
    assert calls[1] == (2, torch.bfloat16, torch.float32)
