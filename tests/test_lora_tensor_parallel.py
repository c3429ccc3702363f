"""LoRA with tensor parallelism over real processes (TP=2, gloo on the CPU): every
adapter's greedy tokens equal one rank's and transformers + peft's, alone and in a
batch that mixes adapters with base rows (fewer slots than adapters, so slots are
rewritten on every rank), with KV heads split and with them replicated; adapters
loaded, unloaded and reloaded at run time reach the worker; rank 0's adapter
events reach a worker's `LoRAModel` intact, and adapters rank 0 no longer holds
are dropped there too."""

from __future__ import annotations

import asyncio
import gc
import shutil
from pathlib import Path

import pytest
from lora_adapters import AdapterCase, make_adapter, peft_greedy

from asyncllm import AsyncLLM, EngineArgs, LoRARequest, SamplingParams
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(240)

MAX_TOKENS = 8
PROMPTS = [[1, 306, 4966, 304, 1074, 278], [1, 450, 4996, 17354]]
# KV heads split over the two ranks, and one KV head that both ranks hold
CONFIGS = {"kv-split": dict(num_key_value_heads=2), "kv-replicated": dict(num_key_value_heads=1)}
# every projection; attention only (q/k/v cut by their own heads, o by its inputs);
# the MLP only (gate/up cut by their columns, down by its inputs); rsLoRA on k and o
ADAPTERS = [
    dict(r=8),
    dict(r=4, targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    dict(r=16, alpha=8.0, targets=("gate_proj", "up_proj", "down_proj")),
    dict(r=8, use_rslora=True, targets=("k_proj", "o_proj")),
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def _tokens(outputs: list) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_two_ranks_give_one_ranks_and_peft_tokens(name: str, tmp_path: Path) -> None:
    case = AdapterCase(
        tmp_path, "llama", CONFIGS[name], ADAPTERS, seed=200, prompts=PROMPTS, max_tokens=MAX_TOKENS
    )
    assert all(ref != case.base_ref for ref in case.refs)
    prompts, loras, expected = [], [], []
    for p, prompt in enumerate(PROMPTS):
        for a in [None, *range(len(case.loras)), None]:
            prompts.append(prompt)
            loras.append(None if a is None else case.loras[a])
            expected.append(case.base_ref[p] if a is None else case.refs[a][p])
    mixed = {}
    for tp in (1, 2):
        # fewer slots than adapters: slots are rewritten
        llm = case.llm(tensor_parallel_size=tp, max_loras=2)
        core = llm.engine.core
        assert core is not None
        try:
            if tp == 2:  # each adapter alone
                for lora, ref in zip(case.loras, case.refs, strict=True):
                    assert _tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora)) == ref
            mixed[tp] = _tokens(llm.generate(prompts, GREEDY, lora_request=loras))
            assert core.runner.lora.slots.num_loads > 2  # slots were rewritten
        finally:
            core.close()  # stops the workers (LLM's shutdown leaves an in-process core)
            llm.shutdown()
    assert mixed[2] == mixed[1] == expected


def test_load_unload_and_reload_at_run_time(tmp_path: Path) -> None:
    """Through a real engine-core process: an adapter loaded while the engine runs,
    then unloaded, its files replaced by another adapter's and loaded again under
    the same name and id, gives the new weights on both ranks."""
    model = make_tiny_model(tmp_path / "model", "llama")
    paths = {n: make_adapter(model, tmp_path / n, seed=s, r=8) for n, s in (("a", 7), ("b", 8))}
    refs = {n: peft_greedy(model, p, PROMPTS, MAX_TOKENS) for n, p in paths.items()}
    assert refs["a"] != refs["b"]
    a = LoRARequest("a", 1, str(paths["a"]))

    async def generate(engine: AsyncLLM, rid: str, lora: LoRARequest | None) -> list[list[int]]:
        async def one(i: int, prompt: list[int]) -> list[int]:
            ids: list[int] = []
            stream = engine.generate({"prompt_token_ids": prompt}, GREEDY, f"{rid}-{i}", lora)
            async for out in stream:
                ids = list(out.outputs[0].token_ids)
            return ids

        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))

    async def main() -> dict[str, list[list[int]]]:
        args = EngineArgs(
            model=str(model), dtype="float32", tensor_parallel_size=2, enable_lora=True,
            max_lora_rank=8,
        )  # fmt: skip
        engine = AsyncLLM.from_engine_args(args)
        fields = {"lora_name": "a", "lora_int_id": 1, "lora_path": str(paths["a"])}
        try:
            got = {"base": await generate(engine, "base", None)}
            assert await engine.call_utility("add_lora", fields)
            assert await engine.call_utility("list_loras", None) == ["a"]
            got["a"] = await generate(engine, "a", a)
            assert await engine.call_utility("remove_lora", 1)
            shutil.rmtree(paths["a"])
            shutil.copytree(paths["b"], paths["a"])
            assert await engine.call_utility("add_lora", fields)
            got["reloaded"] = await generate(engine, "reloaded", a)
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    assert got["base"] == peft_greedy(model, None, PROMPTS, MAX_TOKENS)
    assert got["a"] == refs["a"]
    assert got["reloaded"] == refs["b"]


def test_rank_zeros_events_reach_a_workers_model(tmp_path: Path) -> None:
    """In one process: rank 0's feed (reads, slot writes, drops) applied by a
    worker's mirror writes the very slot contents rank 0 wrote, and forgets an
    adapter once rank 0's last reference to it is gone (unloaded, its rows gone,
    its slot rewritten)."""
    import torch

    from asyncllm.lora.model import LoRAModel
    from asyncllm.lora.ranks import AdapterFeed, AdapterMirror
    from asyncllm.models.hf_config import load_hf_config
    from asyncllm.models.loader import load_model

    model_dir = make_tiny_model(tmp_path / "model", "llama")
    paths = [make_adapter(model_dir, tmp_path / f"é {i}", seed=3 + i, r=4) for i in range(2)]

    def lora_model() -> LoRAModel:
        cfg = load_hf_config(model_dir)
        model = load_model(model_dir, cfg, torch.float32, torch.device("cpu"), None)
        return LoRAModel(
            model, max_loras=1, max_lora_rank=8, max_cpu_loras=1, max_rows=4,
            dtype=torch.float32, device=torch.device("cpu"),
        )  # fmt: skip

    def same_slot(slot: int) -> None:
        for mine, theirs in zip(rank0.slots.layers, worker.slots.layers, strict=True):
            assert torch.equal(mine.a[slot], theirs.a[slot])
            assert torch.equal(mine.b[slot], theirs.b[slot])

    rank0, worker = lora_model(), lora_model()
    feed, mirror = AdapterFeed(rank0), AdapterMirror(worker, same_files=True)
    try:
        first = rank0.host.get(LoRARequest("näme\0x", 5, str(paths[0])))  # any name travels
        rank0.add_row(0, first)
        rank0.add_row(1, first)
        mirror.apply(feed.take())
        same_slot(0)
        assert rank0.slots.layers[0].b[0].abs().sum() > 0
        serial = first.serial
        assert mirror.held() == [serial]
        rank0.remove_row(0)
        rank0.remove_row(1)
        assert rank0.host.remove(5)
        del first
        rank0.add_row(0, rank0.host.get(LoRARequest("other", 6, str(paths[1]))))
        gc.collect()
        mirror.apply(feed.take())  # the second adapter in slot 0, the first dropped
        same_slot(0)
        assert serial not in mirror.held() and len(mirror.held()) == 1
    finally:
        mirror.close()
