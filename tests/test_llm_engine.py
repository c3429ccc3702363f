"""The engine end to end through `LLM`, against transformers on the same tiny
random-weight models: greedy equality, chunked prefill, preemption, prefix
caching, block accounting, sampling and input validation."""

from __future__ import annotations

import pytest
import torch

from asyncllm import LLM, InvalidRequestError, SamplingParams
from tiny_models import hf_greedy, make_tiny_model

# every test runs with and without overlap scheduling (conftest.scheduling_mode)
pytestmark = pytest.mark.usefixtures("scheduling_mode")

PROMPT_LENS = (5, 9, 17, 30)
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def model_dir(request, tmp_path_factory):
    tokenizer = {"llama": "llama-2", "qwen2": "qwen2.5"}[request.param]
    return make_tiny_model(
        tmp_path_factory.mktemp(request.param), arch=request.param, tokenizer=tokenizer
    )


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def prompts_for(vocab_size: int, lens=PROMPT_LENS, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in lens]


def greedy(max_tokens=MAX_TOKENS, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def token_ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def assert_no_leaks(llm: LLM):
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    pool = core.kv_cache.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def spy_schedule(llm: LLM) -> list[dict[str, int]]:
    """Record each step's token allocation."""
    sched = llm.engine.core.scheduler
    seen: list[dict[str, int]] = []
    original = sched.schedule

    def schedule():
        so = original()
        seen.append(dict(so.num_scheduled_tokens))
        return so

    sched.schedule = schedule  # type: ignore[method-assign]
    return seen


@pytest.fixture(scope="module")
def reference(model_dir):
    from asyncllm.models.hf_config import load_hf_config

    vocab = load_hf_config(model_dir).vocab_size
    prompts = prompts_for(vocab)
    return prompts, hf_greedy(model_dir, prompts, MAX_TOKENS)


def test_greedy_matches_transformers_with_mixed_steps(model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(model_dir), multiprocess=False, dtype="float32", max_num_batched_tokens=24)
    steps = spy_schedule(llm)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outputs) == expected
    mixed = [s for s in steps if 1 in s.values() and any(n > 1 for n in s.values())]
    assert mixed, "no step mixed a decode with a prompt chunk"
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outputs)
    assert_no_leaks(llm)


@pytest.mark.parametrize(
    "engine_args",
    [
        pytest.param({"max_num_batched_tokens": 4}, id="chunked-prefill"),
        pytest.param({"num_kv_blocks": 6, "block_size": 8, "max_model_len": 48}, id="preemption"),
    ],
)
def test_same_tokens_through_chunking_and_preemption(model_dir, reference, engine_args):
    prompts, expected = reference
    llm = LLM(str(model_dir), multiprocess=False, dtype="float32", **engine_args)
    outputs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outputs) == expected
    if "num_kv_blocks" in engine_args:
        assert llm.engine.core.scheduler.num_preemptions > 0
    assert_no_leaks(llm)


def test_prefix_cache_hits_give_same_tokens(llama_dir):
    from asyncllm.models.hf_config import load_hf_config

    vocab = load_hf_config(llama_dir).vocab_size
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, vocab, (64,), generator=g).tolist()
    prompts = [shared + torch.randint(3, vocab, (n,), generator=g).tolist() for n in (3, 7, 11)]
    expected = hf_greedy(llama_dir, prompts, 8)
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32", block_size=16)
    first = llm.generate(prompts[:1], greedy(8), use_tqdm=False)
    rest = llm.generate(prompts[1:], greedy(8), use_tqdm=False)
    assert token_ids(first + rest) == expected
    stats = llm.engine.core.stats()
    assert stats.prefix_cache_hits == 2 * 64  # both later prompts reuse the 4 shared blocks
    assert_no_leaks(llm)


def test_abort_returns_every_block(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    engine = llm.engine
    for i, prompt in enumerate(prompts_for(1000, (20, 40, 60))):
        engine.add_request(f"r{i}", prompt, greedy(50))
    engine.step()
    engine.step()
    assert engine.core.kv_cache.num_free_blocks < engine.core.kv_cache.pool.num_blocks
    finals = engine.abort_request(["r0", "r1", "r2"])
    assert {o.request_id for o in finals} == {"r0", "r1", "r2"}
    assert all(o.outputs[0].finish_reason == "abort" for o in finals)
    assert_no_leaks(llm)


def test_seeded_sampling_is_reproducible_across_batches(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    prompts = prompts_for(1000, (6, 10, 14, 8))
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    other = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=14, ignore_eos=True)
    alone = token_ids(llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    again = token_ids(llm.generate([prompts[0]], seeded, use_tqdm=False))[0]
    mixed = llm.generate(prompts, [other, seeded, other, seeded], use_tqdm=False)
    # the same seed gives the same tokens whatever else runs in the batch
    mixed2 = llm.generate([prompts[1], prompts[0]], [other, seeded], use_tqdm=False)
    assert alone == again == mixed2[1].outputs[0].token_ids
    assert token_ids(mixed)[1] == token_ids(llm.generate([prompts[1]], seeded, use_tqdm=False))[0]
    unseeded = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True)
    draws = {
        tuple(token_ids(llm.generate([prompts[0]], unseeded, use_tqdm=False))[0]) for _ in range(3)
    }
    assert len(draws) > 1, "unseeded sampling should vary between calls"


def test_a_generate_call_reaches_the_core_process_in_one_message(llama_dir):
    """The core admits a generate call's requests together, so the first steps do
    not depend on how fast the front end sends (the batch's composition decides
    float rounding in the default mode: run-to-run reproducibility)."""
    with LLM(str(llama_dir), dtype="float32") as llm:
        client = llm.engine.client
        assert client is not None
        sent = []
        send = client.add_requests

        def counting(requests):
            sent.append(len(requests))
            send(requests)

        client.add_requests = counting
        prompts = prompts_for(1000, (6, 10, 14, 8))
        params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, n=2, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        llm.generate(prompts[0], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [2] * 4
    assert sent == [8, 2]


def test_top_k_one_and_tiny_top_p_equal_greedy(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    prompts = prompts_for(1000, (6, 12))
    expected = token_ids(llm.generate(prompts, greedy(), use_tqdm=False))
    top_k = SamplingParams(temperature=1.0, top_k=1, max_tokens=MAX_TOKENS, ignore_eos=True)
    top_p = SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=MAX_TOKENS, ignore_eos=True)
    assert token_ids(llm.generate(prompts, top_k, use_tqdm=False)) == expected
    assert token_ids(llm.generate(prompts, top_p, use_tqdm=False)) == expected


def test_penalties_change_the_distribution_as_documented(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    prompt = prompts_for(1000, (8,))[0]
    base = token_ids(llm.generate([prompt], greedy(40), use_tqdm=False))[0]
    # a huge presence penalty forbids repeating any generated token
    fresh = token_ids(llm.generate([prompt], greedy(40, presence_penalty=2.0), use_tqdm=False))[0]
    assert len(set(base)) < len(base), "the tiny model should repeat itself without penalties"
    assert len(set(fresh)) > len(set(base))
    # repetition penalty also covers the prompt
    rep = token_ids(llm.generate([prompt], greedy(40, repetition_penalty=10.0), use_tqdm=False))[0]
    assert not set(rep) & set(prompt) or len(set(rep)) > len(set(base))


def test_logprobs_and_prompt_logprobs(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    prompt = prompts_for(1000, (7,))[0]
    out = llm.generate([prompt], greedy(5, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 5
    for token, entry in zip(comp.token_ids, comp.logprobs, strict=True):
        assert token in entry
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert 3 <= len(entry) <= 4
    assert comp.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(comp.token_ids, comp.logprobs, strict=True))
    )
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for token, entry in zip(prompt[1:], out.prompt_logprobs[1:], strict=True):
        assert token in entry and entry[token].logprob <= 0.0


def test_too_long_prompt_fails_alone(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32", max_model_len=32)
    engine = llm.engine
    engine.add_request("ok1", prompts_for(1000, (5,))[0], greedy(4))
    with pytest.raises(InvalidRequestError, match="max_model_len=32"):
        engine.add_request("long", prompts_for(1000, (40,))[0], greedy(4))
    engine.add_request("ok2", prompts_for(1000, (6,))[0], greedy(4))
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {"ok1", "ok2"}
    with pytest.raises(InvalidRequestError, match="prompt 1"):
        llm.generate([[5, 6], list(range(3, 43))], greedy(4), use_tqdm=False)
    assert_no_leaks(llm)


def test_max_model_len_ends_generation(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32", max_model_len=20)
    out = llm.generate([prompts_for(1000, (15,))[0]], greedy(100), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    assert out.outputs[0].finish_reason == "length"


def test_text_prompts_and_n_children(llama_dir):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    outs = llm.generate(
        ["Hello world", {"prompt_token_ids": [1, 15043]}], greedy(4, n=1), use_tqdm=False
    )
    assert outs[0].prompt == "Hello world"
    assert outs[0].prompt_token_ids == llm.get_tokenizer().encode("Hello world")
    assert outs[1].prompt_token_ids == [1, 15043]
    tok = llm.get_tokenizer()
    assert outs[0].outputs[0].text == tok.decode(outs[0].outputs[0].token_ids)
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    out = llm.generate(["Hello"], params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert_no_leaks(llm)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_output_and_the_core_request(llama_dir, include):
    llm = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    prompt = prompts_for(1000, (9,))[0]
    full = llm.generate([prompt], greedy(40), use_tqdm=False)[0].outputs[0]
    assert full.text == llm.get_tokenizer().decode(full.token_ids)
    stop = full.text[len(full.text) // 2 :][:3]
    cut = full.text.index(stop)
    out = llm.generate(
        [prompt], greedy(40, stop=[stop], include_stop_str_in_output=include), use_tqdm=False
    )[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert out.text == full.text[: cut + (len(stop) if include else 0)]
    # the kept tokens are a prefix of the full run, ending with the one that completed the stop
    assert out.token_ids == full.token_ids[: len(out.token_ids)]
    assert len(out.token_ids) < len(full.token_ids)
    assert stop in llm.get_tokenizer().decode(out.token_ids)
    assert_no_leaks(llm)


def spy_preemptions(llm: LLM) -> list[tuple[int, int]]:
    """Record (computed tokens, prompt tokens) of each request when it is preempted."""
    sched = llm.engine.core.scheduler
    seen: list[tuple[int, int]] = []
    original = sched._preempt

    def preempt(request):
        seen.append((request.num_computed_tokens, request.num_prompt_tokens))
        original(request)

    sched._preempt = preempt  # type: ignore[method-assign]
    return seen


def test_prompt_logprobs_survive_preemption_mid_prompt(llama_dir):
    # Chunks of 8 tokens and a cache of 6 blocks of 8: the first request's decode
    # outgrows the cache while the second is still in its prompt, which is then
    # preempted and recomputed from its start.
    prompts = prompts_for(1000, (30, 30), seed=5)
    params = greedy(12, prompt_logprobs=2)
    small = LLM(
        str(llama_dir),
        multiprocess=False,
        dtype="float32",
        num_kv_blocks=6,
        block_size=8,
        max_model_len=48,
        max_num_batched_tokens=8,
    )
    preempted = spy_preemptions(small)
    got = small.generate(prompts, params, use_tqdm=False)
    assert any(done < prompt for done, prompt in preempted), preempted
    assert_no_leaks(small)

    roomy = LLM(str(llama_dir), multiprocess=False, dtype="float32", max_num_batched_tokens=8)
    want = roomy.generate(prompts, params, use_tqdm=False)
    for g, w, prompt in zip(got, want, prompts, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert len(g.prompt_logprobs) == len(prompt)
        assert g.prompt_logprobs[0] is None
        for token, g_row, w_row in zip(
            prompt[1:], g.prompt_logprobs[1:], w.prompt_logprobs[1:], strict=True
        ):
            assert list(g_row) == list(w_row) and token in g_row
            for tid, lp in g_row.items():
                assert lp.rank == w_row[tid].rank
                assert lp.logprob == pytest.approx(w_row[tid].logprob, abs=1e-4)


def test_prompt_logprobs_are_the_same_in_slices(llama_dir, monkeypatch):
    # A chunk's logits are computed a few rows at a time; the rows must not depend
    # on the slicing.
    from asyncllm.worker import prompt_logprobs

    prompt = prompts_for(1000, (40,), seed=6)[0]
    params = greedy(2, prompt_logprobs=3)
    whole = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    want = whole.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    vocab = whole.engine.core.vocab_size
    monkeypatch.setattr(prompt_logprobs, "MAX_LOGIT_ELEMENTS", 3 * vocab)
    sliced = LLM(str(llama_dir), multiprocess=False, dtype="float32")
    assert sliced.engine.core.runner._prompt_logprobs.slice_rows == 3
    got = sliced.generate([prompt], params, use_tqdm=False)[0].prompt_logprobs
    assert got[0] is None and want[0] is None
    for g_row, w_row in zip(got[1:], want[1:], strict=True):
        assert list(g_row) == list(w_row)
        for tid, lp in g_row.items():
            assert lp.rank == w_row[tid].rank
            assert lp.logprob == pytest.approx(w_row[tid].logprob, abs=1e-5)
