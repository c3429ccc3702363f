"""Adapters unloaded and reloaded while other requests stream, against a real
engine-core process: a running request finishes with the adapter it started with,
a request after the reload gets the new weights (even from the same path, whose
old prefix-cache blocks must not be reused), and nothing else changes."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from lora_adapters import make_adapter, peft_greedy

from asyncllm import AsyncLLM, EngineArgs, LoRARequest, SamplingParams
from tiny_models import make_tiny_model

pytestmark = pytest.mark.timeout(300)

PROMPT = [1, 306, 4966, 304, 1074, 278, 450, 4996, 17354, 15043]
MAX_TOKENS = 160
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_reload")
    model = make_tiny_model(tmp / "model", arch="llama")
    paths = {
        n: make_adapter(model, tmp / n, seed=s, r=8) for n, s in (("a", 1), ("b", 2), ("c", 3))
    }
    refs = {n: peft_greedy(model, p, [PROMPT], MAX_TOKENS)[0] for n, p in paths.items()}
    refs["base"] = peft_greedy(model, None, [PROMPT], MAX_TOKENS)[0]
    assert len({tuple(r) for r in refs.values()}) == 4
    return {"tmp": tmp, "model": model, "paths": paths, "refs": refs}


async def _tokens(engine: AsyncLLM, rid: str, lora: LoRARequest | None, started: asyncio.Event):
    ids: list[int] = []
    async for out in engine.generate({"prompt_token_ids": PROMPT}, GREEDY, rid, lora):
        ids = list(out.outputs[0].token_ids)  # cumulative
        started.set()
    return ids


def test_unload_and_reload_while_streaming(setup: dict) -> None:
    paths, refs = setup["paths"], setup["refs"]
    a = LoRARequest("a", 1, str(paths["a"]))
    b = LoRARequest("b", 2, str(paths["b"]))

    async def main() -> dict[str, list[int]]:
        args = EngineArgs(
            model=str(setup["model"]), dtype="float32", enable_lora=True, max_loras=2,
            max_lora_rank=8, block_size=4,
        )  # fmt: skip
        engine = AsyncLLM.from_engine_args(args)
        try:
            warm = asyncio.Event()
            assert await _tokens(engine, "warm", a, warm) == refs["a"]  # caches a's blocks
            events = {n: asyncio.Event() for n in ("a", "base", "b")}
            running = {
                n: asyncio.ensure_future(_tokens(engine, f"r-{n}", lora, events[n]))
                for n, lora in (("a", a), ("base", None), ("b", b))
            }
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events.values())), 60)
            # while they stream: a out, c's files over a's path, a back in (same id)
            assert await engine.call_utility("remove_lora", 1)
            shutil.rmtree(paths["a"])
            shutil.copytree(paths["c"], paths["a"])
            await engine.call_utility("add_lora", {"lora_name": "a", "lora_int_id": 1,
                                                   "lora_path": str(paths["a"])})  # fmt: skip
            assert not any(t.done() for t in running.values())  # still streaming
            later = asyncio.ensure_future(_tokens(engine, "r-new", a, asyncio.Event()))
            # b reloaded from its unchanged files: the same adapter again
            assert await engine.call_utility("remove_lora", 2)
            again = asyncio.ensure_future(_tokens(engine, "r-b2", b, asyncio.Event()))
            got = {n: await t for n, t in running.items()}
            got["new"] = await later
            got["b2"] = await again
            return got
        finally:
            engine.shutdown()

    got = asyncio.run(main())
    assert got["a"] == refs["a"]  # started before the reload: a's weights to the end
    assert got["base"] == refs["base"]
    assert got["b"] == refs["b"]
    assert got["new"] == refs["c"]  # after: the new weights at the same path and id
    assert got["b2"] == refs["b"]
