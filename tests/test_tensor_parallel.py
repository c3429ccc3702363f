"""Tensor parallelism over real processes (gloo on the CPU): TP=2 gives TP=1's and
transformers' greedy tokens, and TP=1's logprobs, through chunked prefill,
preemption and prefix-cache hits; a worker's death is the engine's death; a
worker that fails to start reports its own error; workers never outlive the core.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from asyncllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams
from asyncllm.errors import ConfigError, EngineStartupError, ModelLoadError
from asyncllm.models.hf_config import load_hf_config
from engine_streams import alive, stream_length
from tiny_models import hf_greedy, make_tiny_model

pytestmark = pytest.mark.timeout(240)

CONFIGS = {
    "llama-gqa": dict(arch="llama", tokenizer="llama-2"),  # 4 query heads, 2 KV heads
    # an odd vocabulary: the last rank's embedding and LM-head shard is padded
    "qwen2-bias-tied": dict(
        arch="qwen2", tokenizer="llama-2", tie_word_embeddings=True, vocab_size=32001
    ),
    "fewer-kv-heads-than-ranks": dict(arch="llama", tokenizer="llama-2", num_key_value_heads=1),
}
# A small KV pool and step budget: long prompts are chunked, requests are
# preempted, and the second wave's prompts hit the first wave's cached prefix.
ENGINE = dict(
    dtype="float32",
    block_size=8,
    num_kv_blocks=10,
    max_model_len=64,
    max_num_batched_tokens=16,
)


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    g = torch.Generator().manual_seed(5)

    def rand(n: int) -> list[int]:
        return torch.randint(3, vocab, (n,), generator=g).tolist()

    shared = rand(16)
    return [shared + rand(3)], [shared + rand(7), rand(9), shared + rand(14), rand(30)]


def _run(
    model_dir: Path, tp: int, waves: tuple[list[list[int]], ...], **kw: object
) -> tuple[list, dict]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    # the last prompt also asks for prompt logprobs: more logits than the sampled rows'
    scored = SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=2
    )
    llm = LLM(str(model_dir), multiprocess=False, tensor_parallel_size=tp, **ENGINE, **kw)
    core = llm.engine.core
    assert core is not None
    try:
        outputs = []
        for wave in waves:
            wave_params = [params] * (len(wave) - 1) + [scored if len(wave) > 1 else params]
            outputs += llm.generate(wave, wave_params, use_tqdm=False)
        stats = core.stats()
        return outputs, {"preemptions": stats.num_preemptions, "hits": stats.prefix_cache_hits}
    finally:
        core.close()  # stops the workers (LLM's shutdown leaves an in-process core as is)
        llm.shutdown()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_give_one_ranks_and_transformers_tokens(name, tmp_path):
    model_dir = make_tiny_model(tmp_path / name, **CONFIGS[name])  # type: ignore[arg-type]
    waves = _prompts(load_hf_config(model_dir).vocab_size)
    expected = hf_greedy(model_dir, [p for wave in waves for p in wave], 12)
    one, _ = _run(model_dir, 1, waves)
    # one case with overlap scheduling: the model runs on the runner thread
    two, stats = _run(model_dir, 2, waves, async_scheduling=name.startswith("fewer"))
    assert [o.outputs[0].token_ids for o in two] == expected
    assert [o.outputs[0].token_ids for o in one] == expected
    assert stats["preemptions"] > 0 and stats["hits"] > 0, stats
    assert two[-1].prompt_logprobs is not None
    pairs = [(a.outputs[0].logprobs, b.outputs[0].logprobs) for a, b in zip(one, two, strict=True)]
    pairs.append((one[-1].prompt_logprobs[1:], two[-1].prompt_logprobs[1:]))
    for a, b in pairs:
        for la, lb in zip(a, b, strict=True):
            assert la.keys() == lb.keys()
            for token in la:
                assert abs(la[token].logprob - lb[token].logprob) < 1e-4


def _workers(pid: int) -> list[int]:
    """The live tensor-parallel worker processes started by process `pid`."""
    kids: list[int] = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            kids += [int(x) for x in f.read().split()]
    found = []
    for kid in kids:
        with open(f"/proc/{kid}/cmdline", "rb") as f:
            if b"asyncllm.executor.worker_proc" in f.read() and alive(kid):
                found.append(kid)
    return found


LONG = SamplingParams(max_tokens=100_000, ignore_eos=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


@pytest.mark.parametrize("victim", ["worker", "hung-worker", "core"])
def test_a_dead_rank_is_a_dead_engine_and_no_worker_outlives_the_core(llama_dir, victim):
    """A killed worker, or a stopped one (no heartbeat for HANG_S: the watchdog
    kills it): the core (here in a thread of this process) fails every request.
    A killed core (its own process): its worker exits within 5 s."""
    args = EngineArgs(model=str(llama_dir), dtype="float32", tensor_parallel_size=2)

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(args, multiprocess=victim == "core")
        process = engine.client.process
        core_pid = os.getpid() if process is None else process.pid
        try:
            tasks = [
                asyncio.create_task(stream_length(engine, [5 + i, 6, 7], f"k{i}", LONG))
                for i in range(4)
            ]
            await asyncio.sleep(1.0)
            workers = _workers(core_pid)
            assert len(workers) == 1, workers
            if victim == "hung-worker":
                os.kill(workers[0], signal.SIGSTOP)
            else:
                os.kill(workers[0] if victim == "worker" else core_pid, signal.SIGKILL)
            # a hang guard: unfailed, the streams would run for minutes
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=60
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            # the cause is named: the killed or hung rank, or the core's own death
            if victim == "core":
                assert "code -9" in str(results[0]), results[0]
            else:
                assert "tensor-parallel rank 1" in str(results[0])
                assert ("SIGKILL" if victim == "worker" else "no heartbeat") in str(results[0])
            deadline = time.monotonic() + 30  # a bound on "outlived", not a speed
            while alive(workers[0]) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not alive(workers[0]), "a worker outlived its engine core"
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_a_worker_start_up_failure_reports_its_error(tmp_path):
    from asyncllm.executor.multiproc import MultiprocExecutor

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", tokenizer="llama-2")
    config = EngineArgs(model=str(model_dir), tensor_parallel_size=2).resolve(
        load_hf_config(model_dir)
    )
    (model_dir / "model.safetensors").unlink()  # after rank 0 read its config
    executor = MultiprocExecutor(config)
    try:
        executor.start()
        with pytest.raises(EngineStartupError, match=r"rank 1 failed to start: ModelLoadError"):
            executor.wait_ready(120)
    finally:
        executor.shutdown()
    assert all(w.proc.poll() is not None for w in executor.workers)


def test_bad_sizes_fail_with_the_field_named():
    from asyncllm.models.parallel_layers import TPLayout

    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineArgs(tensor_parallel_size=2, executor="null")
    cfg = type("Cfg", (), dict(num_attention_heads=4, intermediate_size=128, vocab_size=10))
    with pytest.raises(ModelLoadError, match="tensor_parallel_size=3 does not divide"):
        TPLayout.of(cfg, 2, 0, 3)
    with pytest.raises(ModelLoadError, match="KV heads"):
        TPLayout.of(
            type("C", (), dict(num_attention_heads=6, intermediate_size=6, vocab_size=9)), 4, 0, 6
        )
    layout = TPLayout.of(cfg, 1, 1, 2)  # one KV head, two ranks: replicated
    assert (layout.num_heads, layout.num_kv_heads, layout.first_kv_head) == (2, 1, 0)
    assert layout.vocab_per_rank == 5


def test_host_ip_picks_the_ranks_address_and_must_be_this_machines(monkeypatch):
    """ASYNCLLM_HOST_IP overrides the address rank 0 binds its rendezvous to (over
    Ray); a value that is not an IP, or not one of this machine's, fails naming it."""
    from asyncllm.executor.distributed import host_address

    def ray_default() -> str:
        return "192.0.2.7"

    monkeypatch.delenv("ASYNCLLM_HOST_IP", raising=False)
    assert host_address(ray_default) == "192.0.2.7"
    monkeypatch.setenv("ASYNCLLM_HOST_IP", "127.0.0.1")
    assert host_address(ray_default) == "127.0.0.1"
    monkeypatch.setenv("ASYNCLLM_HOST_IP", "node-a")
    with pytest.raises(ConfigError, match="ASYNCLLM_HOST_IP='node-a' is not an IP address"):
        host_address(ray_default)
    monkeypatch.setenv("ASYNCLLM_HOST_IP", "192.0.2.1")  # TEST-NET-1: on no interface here
    with pytest.raises(ConfigError, match="not an address of this machine"):
        host_address(ray_default)
