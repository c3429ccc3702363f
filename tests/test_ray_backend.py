"""Engine cores placed by Ray (`--data-parallel-backend ray`), on a one-node Ray
cluster started here: outputs equal local cores', the front end listens only on the
address given and only the core's CURVE key gets in (a forged ENGINE_ERROR from a peer
that knows the server's public key does nothing), and a killed core is the engine's
death, as a local one's is."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import zmq

from asyncllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams, _core
from tiny_models import make_tiny_model

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'asyncllm[ray]'")

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5 + i, 17, 301 + 3 * i, 42, 9 + i] for i in range(8)]


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def test_ray_placed_cores_give_local_cores_outputs(model_dir, ray_cluster):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    outputs = {}
    for backend, dp in (("mp", 1), ("ray", 2)):
        with LLM(
            str(model_dir),
            dtype="float32",
            max_model_len=128,
            data_parallel_size=dp,
            data_parallel_backend=backend,
            data_parallel_address="127.0.0.1",
        ) as llm:
            outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        outputs[backend] = [o.outputs[0].token_ids for o in outs]
    assert outputs["ray"] == outputs["mp"]


async def _count(engine: AsyncLLM, prompt: list[int], rid: str, params: SamplingParams) -> int:
    n = 0
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        n = len(out.outputs[0].token_ids)
    return n


def test_only_the_cores_key_gets_in_and_a_killed_core_is_the_engines_death(model_dir, ray_cluster):
    args = EngineArgs(
        model=str(model_dir),
        executor="null",
        null_step_delay_ms=2.0,
        data_parallel_backend="ray",
        data_parallel_address="127.0.0.1",
    )

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(args)
        ctx = zmq.Context()
        try:
            process = engine.client.process
            for addr in (process.input_addr, process.output_addr):
                assert addr.startswith("tcp://127.0.0.1:"), addr
            # Peers that push a fatal frame into the front end's output socket: one
            # with no CURVE at all, one with its own key pair and the server's public
            # key. Neither completes the handshake, so the engine never sees the frame.
            plain = ctx.socket(zmq.PUSH)
            forger = ctx.socket(zmq.PUSH)
            forger.curve_serverkey = process._keys.server_public
            forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
            for sock in (plain, forger):
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(process.output_addr)
                sock.send(_core.encode_engine_error("forged"), flags=zmq.NOBLOCK)
            await asyncio.sleep(1.0)
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            assert await _count(engine, [3, 4, 5], "after", params) == 4
            assert engine.is_running

            long = SamplingParams(max_tokens=100_000, ignore_eos=True)
            task = asyncio.create_task(_count(engine, [7, 8], "long", long))
            await asyncio.sleep(0.3)
            os.kill(process.pid, signal.SIGKILL)
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, timeout=10)
            assert time.monotonic() - t0 < 5
            assert not engine.is_running
        finally:
            ctx.destroy(linger=0)
            engine.shutdown()

    asyncio.run(run())
