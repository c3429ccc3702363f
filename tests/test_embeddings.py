"""Embeddings from the engine: `LLM.embed` and `AsyncLLM.embed` equal transformers'
final hidden states (after the model's last norm) pooled the same way, alone, in
one step with generation, under chunked prefill, and on a prefix-cache hit; the
requests keep no KV once their prompt is computed.

Tolerance: 1e-5 (absolute and relative, `torch.testing.assert_close`) on the raw
pooled vectors of a tiny random-weight Llama in float32 (seed 0), whose hidden
states are of order 1 after the final RMSNorm."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from asyncllm import LLM, AsyncLLM, EngineArgs, InvalidRequestError, PoolingParams, SamplingParams
from asyncllm.errors import ConfigError
from asyncllm.outputs import EmbeddingRequestOutput, RequestOutput
from asyncllm.sampling_params import RequestOutputKind
from tiny_models import hf_greedy, make_tiny_model

TOL = dict(atol=1e-5, rtol=1e-5)
BLOCK = 16
BUDGET = 48  # max_num_batched_tokens: prompts longer than this run in chunks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-embed"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_pooled(hf_model, prompt: list[int], pooling: str) -> torch.Tensor:
    """transformers' last hidden states of `prompt` (after the final norm), pooled."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([prompt])).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(0)


def prompt(seed: int, length: int, vocab: int = 32000) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def make_llm(model_dir, **kwargs) -> LLM:
    args = dict(
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=BUDGET,
        max_model_len=512,
        num_threads=1,
    )
    return LLM(model=str(model_dir), **{**args, **kwargs})


@pytest.fixture(scope="module")
def llm(model_dir):
    """Through the wire: the core in its own process."""
    with make_llm(model_dir) as engine:
        yield engine


def check(out: EmbeddingRequestOutput, want: torch.Tensor) -> None:
    got = torch.tensor(out.outputs.embedding)
    torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embeddings_equal_transformers_alone(llm, hf_model, pooling):
    prompts = [prompt(1, 5), prompt(2, 17), prompt(3, 33)]
    outs = llm.embed(prompts, pooling=pooling, normalize=False, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    for p, out in zip(prompts, outs, strict=True):
        assert out.finished and out.outputs.hidden_size == hf_model.config.hidden_size
        check(out, hf_pooled(hf_model, p, pooling))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_long_prompts_pool_over_every_chunk(llm, hf_model, pooling):
    """Longer than the step's token budget: the prompt runs in several steps."""
    prompts = [prompt(4, 3 * BUDGET + 7), prompt(5, 2 * BUDGET)]
    outs = llm.embed(prompts, pooling=pooling, normalize=False, use_tqdm=False)
    for p, out in zip(prompts, outs, strict=True):
        check(out, hf_pooled(hf_model, p, pooling))


def test_normalize_and_dimensions(llm, hf_model):
    p = prompt(6, 21)
    want = hf_pooled(hf_model, p, "last")
    (unit,) = llm.embed([p], use_tqdm=False)  # default: last token, normalized
    check(unit, want / want.norm())
    assert math.isclose(math.fsum(v * v for v in unit.outputs.embedding), 1.0, rel_tol=1e-9)
    (short,) = llm.embed([p], dimensions=8, use_tqdm=False)
    assert len(short.outputs.embedding) == 8
    check(short, want[:8] / want[:8].norm())
    (raw,) = llm.embed([p], PoolingParams("last", normalize=False, dimensions=8), False)
    check(raw, want[:8])


def test_prefix_cache_hit(model_dir, hf_model):
    """A second request sharing the first's full blocks reads them from the cache
    (last-token pooling); mean pooling computes its whole prompt and is exact too."""
    shared = prompt(7, 2 * BLOCK)
    first, second = shared + prompt(8, 5), shared + prompt(9, 9)
    with make_llm(model_dir, multiprocess=False) as llm:
        (a,) = llm.embed([first], pooling="last", normalize=False, use_tqdm=False)
        (b,) = llm.embed([second], pooling="last", normalize=False, use_tqdm=False)
        assert a.num_cached_tokens == 0 and b.num_cached_tokens == 2 * BLOCK
        check(a, hf_pooled(hf_model, first, "last"))
        check(b, hf_pooled(hf_model, second, "last"))
        (m,) = llm.embed([second], pooling="mean", normalize=False, use_tqdm=False)
        assert m.num_cached_tokens == 0
        check(m, hf_pooled(hf_model, second, "mean"))
        # a generation request reuses the blocks an embedding request left
        (g,) = llm.generate([first], SamplingParams(max_tokens=2, temperature=0), False)
        assert g.num_cached_tokens == 2 * BLOCK
        core = llm.engine.core
        assert core is not None
        assert core.kv_cache.pool.num_free_blocks == core.num_kv_blocks


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_batched_with_generation_in_one_step(model_dir, hf_model, async_scheduling):
    """Generation and embedding requests share steps: the first step holds every
    request's prompt, the embeddings come out of it, generation goes on, and the
    generated ids equal transformers' greedy ones."""
    gen_prompts = [prompt(10, 7), prompt(11, 12)]
    emb_prompts = [prompt(12, 9), prompt(13, 14)]
    with make_llm(
        model_dir, multiprocess=False, async_scheduling=async_scheduling, max_num_batched_tokens=64
    ) as llm:
        engine = llm.engine
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        for i, p in enumerate(gen_prompts):
            engine.add_request(f"g{i}", p, params)
        for i, (p, pooling) in enumerate(zip(emb_prompts, ["last", "mean"], strict=True)):
            engine.add_embedding(f"e{i}", p, PoolingParams(pooling, normalize=False))
        steps: list[list[object]] = []
        while engine.has_unfinished_requests():
            steps.append(engine.step())
        done = {o.request_id: (n, o) for n, outs in enumerate(steps) for o in outs if o.finished}
        first = min(n for n, _ in done.values())  # overlap: the first step reports nothing
        assert done["e0"][0] == done["e1"][0] == first
        # the prompts ran together: that step also gave each generation its first token
        assert {o.request_id for o in steps[first]} == {"g0", "g1", "e0", "e1"}
        assert all(done[f"g{i}"][0] > first for i in range(2))
        check(done["e0"][1], hf_pooled(hf_model, emb_prompts[0], "last"))
        check(done["e1"][1], hf_pooled(hf_model, emb_prompts[1], "mean"))
        want = hf_greedy(model_dir, gen_prompts, 6, model=hf_model)
        for i in range(2):
            out = done[f"g{i}"][1]
            assert isinstance(out, RequestOutput)
            assert out.outputs[0].token_ids == want[i]
        core = engine.core
        assert core is not None
        assert core.kv_cache.pool.num_free_blocks == core.num_kv_blocks


def test_async_llm_embeds_beside_streams(model_dir, hf_model):
    """`AsyncLLM.embed` over the wire, concurrent with a generate stream."""
    p = prompt(14, 40)

    async def run() -> tuple[EmbeddingRequestOutput, list[int]]:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(
                model=str(model_dir),
                dtype="float32",
                max_num_batched_tokens=BUDGET,
                num_threads=1,
            )
        )
        try:
            params = SamplingParams(
                max_tokens=8, temperature=0, ignore_eos=True, output_kind=RequestOutputKind.DELTA
            )

            async def stream() -> list[int]:
                ids: list[int] = []
                async for out in engine.generate(p, params, "gen"):
                    ids += out.outputs[0].token_ids
                return ids

            emb, ids = await asyncio.gather(
                engine.embed(p, PoolingParams("mean", normalize=False), "emb"), stream()
            )
            with pytest.raises(InvalidRequestError, match="dimensions=65 is larger"):
                await engine.embed(p, PoolingParams(dimensions=65))
            return emb, ids
        finally:
            engine.shutdown()

    emb, ids = asyncio.run(run())
    check(emb, hf_pooled(hf_model, p, "mean"))
    assert ids == hf_greedy(model_dir, [p], 8, model=hf_model)[0]


def test_bad_pooling_params_are_refused(llm):
    with pytest.raises(ConfigError, match="pooling='max'"):
        PoolingParams("max")
    with pytest.raises(ConfigError, match="dimensions=0"):
        PoolingParams(dimensions=0)
    with pytest.raises(InvalidRequestError, match="dimensions=65 is larger"):
        llm.embed(["hello"], dimensions=65, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="not both"):
        llm.embed(["hello"], PoolingParams(), pooling="mean")


def test_an_aborted_embedding_frees_its_blocks_and_says_so(model_dir):
    """Aborted mid-prompt (its prompt spans several steps): its state names the
    abort, its output has no vector, and the core holds none of its blocks."""
    with make_llm(model_dir, multiprocess=False) as llm:
        engine = llm.engine
        state = engine.add_embedding("e", prompt(15, 3 * BUDGET), PoolingParams("mean"))
        assert engine.step() == []  # the first chunk ran
        (out,) = engine.abort_request(["e"])
        assert isinstance(out, EmbeddingRequestOutput) and out.outputs.embedding == []
        assert state.error == "request 'e' was aborted" and not engine.has_unfinished_requests()
        core = engine.core
        assert core is not None and not core.has_unfinished_requests()
        assert core.kv_cache.pool.num_free_blocks == core.num_kv_blocks
