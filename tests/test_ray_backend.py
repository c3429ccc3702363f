"""Engine cores (`--data-parallel-backend ray`) and tensor-parallel workers
(`--distributed-executor-backend ray`) placed by Ray, on a simulated two-node Ray
cluster started here (one CPU each, as the issue asks): outputs equal multiprocess
ones, with one tensor-parallel rank on each node; the front end, and rank 0's hub for
the workers, listen only on the address given and let only their peers' CURVE key in
(a forged frame from a peer that knows the server's public key does nothing); a
killed core, or a killed worker's actor, is the engine's death (and the worker exits
with its actor); a worker that fails to start reports its own error; and no actor or
placement group is left after shutdown. One cluster serves the whole module."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import zmq

from asyncllm import LLM, AsyncLLM, EngineArgs, EngineDeadError, SamplingParams, _core
from asyncllm.errors import EngineStartupError
from asyncllm.models.hf_config import load_hf_config
from engine_streams import alive, stream_length
from tiny_models import make_tiny_model

ray = pytest.importorskip("ray", reason="Ray is an optional extra: pip install 'asyncllm[ray]'")

pytestmark = pytest.mark.timeout(240)

PROMPTS = [[5 + i, 17, 301 + 3 * i, 42, 9 + i] for i in range(8)]
_SUPERVISORS = ("_CoreSupervisor", "WorkerSupervisor")


@pytest.fixture(scope="module")
def ray_cluster():
    from ray._private.utils import get_ray_address_file
    from ray.cluster_utils import Cluster

    # The Cluster records itself as this machine's latest (where a plain `ray.init()`
    # would connect, even once it is gone): put back what was there.
    address_file = Path(get_ray_address_file(None))
    before = address_file.read_text() if address_file.exists() else None
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        cluster.add_node(num_cpus=1)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
        if before is None:
            address_file.unlink(missing_ok=True)
        else:
            address_file.write_text(before)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


def _live_actors() -> list[dict]:
    """The engines' actors not dead yet, from the GCS's actor table (the public
    `ray.util.state` needs the dashboard, which the plain `ray` package lacks)."""
    from ray._private.state import actors

    return [
        a for a in actors().values() if a["ActorClassName"] in _SUPERVISORS and a["State"] != "DEAD"
    ]


def _live_groups() -> list[str]:
    table = ray.util.placement_group_table()
    return [g["name"] for g in table.values() if g["state"] != "REMOVED"]


def _assert_nothing_left() -> None:
    """No engine's actor and no placement group outlives its engine (bounded wait:
    Ray reports a kill a moment after it is made)."""
    deadline = time.monotonic() + 60  # a hang guard, not a speed bound
    while (_live_actors() or _live_groups()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live_actors() == [] and _live_groups() == []


def _token_ids(model_dir, params, while_running=None, **engine_kw) -> list[list[int]]:
    """PROMPTS' output ids from an `LLM` built with `engine_kw`; `while_running` is
    called before the engine shuts down."""
    with LLM(str(model_dir), dtype="float32", max_model_len=128, **engine_kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        if while_running is not None:
            while_running()
    return [o.outputs[0].token_ids for o in outs]


def test_ray_placed_cores_give_local_cores_outputs(model_dir, ray_cluster):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True)
    outputs = {
        backend: _token_ids(
            model_dir,
            params,
            data_parallel_size=2,
            data_parallel_backend=backend,
            data_parallel_address="127.0.0.1",
        )
        for backend in ("mp", "ray")
    }
    assert outputs["ray"] == outputs["mp"]
    _assert_nothing_left()


def test_tensor_parallel_ranks_on_two_nodes_give_multiprocess_tokens(model_dir, ray_cluster):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    def one_rank_per_node() -> None:  # one bundle (rank) per node: one CPU each
        (group,) = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert group["name"].startswith("asyncllm-tp-")
        nodes = group["bundles_to_node_id"]
        assert len(nodes) == 2 and nodes[0] != nodes[1], nodes

    outputs = {
        backend: _token_ids(
            model_dir,
            params,
            tensor_parallel_size=2,
            distributed_executor_backend=backend,
            while_running=one_rank_per_node if backend == "ray" else None,
        )
        for backend in ("mp", "ray")
    }
    assert outputs["ray"] == outputs["mp"]
    _assert_nothing_left()


def test_a_killed_worker_actor_is_the_engines_death(model_dir, ray_cluster):
    from asyncllm.executor.ray_executor import NAMESPACE

    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        # the model's whole length: the streams must outlast the second before
        # the kill (at 128 they could end in ~1 s, before it)
        max_model_len=1024,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    long = SamplingParams(max_tokens=100_000, ignore_eos=True)

    async def run() -> None:
        engine = AsyncLLM.from_engine_args(args)
        try:
            tasks = [
                asyncio.create_task(stream_length(engine, [5 + i, 6, 7], f"k{i}", long))
                for i in range(4)
            ]
            await asyncio.sleep(1.0)
            (worker,) = [a for a in _live_actors() if a["ActorClassName"] == "WorkerSupervisor"]
            assert worker["Name"].endswith("-rank1")
            actor = ray.get_actor(worker["Name"], namespace=NAMESPACE)
            pid = ray.get(actor.pid.remote())  # the worker process (this machine here)
            ray.kill(actor, no_restart=True)
            # a hang guard: unfailed, the streams would run for minutes
            results = await asyncio.wait_for(
                asyncio.gather(*tasks, return_exceptions=True), timeout=60
            )
            assert all(isinstance(r, EngineDeadError) for r in results), results
            assert "tensor-parallel rank 1" in str(results[0])
            assert "Ray actor" in str(results[0])
            assert not engine.is_running
            deadline = time.monotonic() + 30  # a bound on "outlived", not a speed
            while alive(pid) and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not alive(pid), "a worker outlived its Ray actor"
        finally:
            engine.shutdown()

    asyncio.run(run())
    _assert_nothing_left()


def test_a_worker_start_up_failure_over_ray_reports_its_error(tmp_path, ray_cluster):
    from asyncllm.executor.ray_executor import RayExecutor

    model_dir = make_tiny_model(tmp_path / "m", arch="llama", tokenizer="llama-2")
    args = EngineArgs(
        model=str(model_dir), tensor_parallel_size=2, distributed_executor_backend="ray"
    )
    config = args.resolve(load_hf_config(model_dir))
    (model_dir / "model.safetensors").unlink()  # after rank 0 read its config
    executor = RayExecutor(config)
    try:
        executor.start()
        with pytest.raises(
            EngineStartupError, match=r"rank 1 \(Ray actor .*\) failed to start: ModelLoadError"
        ):
            executor.wait_ready(120)
    finally:
        executor.shutdown()
    _assert_nothing_left()


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
            assert await stream_length(engine, [3, 4, 5], "after", params) == 4
            assert engine.is_running

            long = SamplingParams(max_tokens=100_000, ignore_eos=True)
            task = asyncio.create_task(stream_length(engine, [7, 8], "long", long))
            await asyncio.sleep(0.3)
            os.kill(process.pid, signal.SIGKILL)
            # a hang guard: unfailed, the stream would run for minutes
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(task, timeout=60)
            assert not engine.is_running
        finally:
            ctx.destroy(linger=0)
            engine.shutdown()

    asyncio.run(run())
    _assert_nothing_left()


def test_the_hub_listens_on_the_address_given_and_admits_only_the_workers_key():
    """Rank 0's rendezvous and status socket (no Ray needed): bound to the address
    given; the workers' key gets a working `dist.Store` and its status through; a
    peer with its own key pair (knowing the server's public key) gets neither."""
    from datetime import timedelta

    from asyncllm.executor.hub import Hub, HubLink, LocalStore

    statuses: list[tuple[int, bytes]] = []
    hub = Hub("127.0.0.1", 2, lambda rank, data: statuses.append((rank, data)))
    link = HubLink(hub.endpoint, hub.keys.client, 1)
    ctx = zmq.Context()
    try:
        assert hub.endpoint.startswith("tcp://127.0.0.1:"), hub.endpoint
        forger = ctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.curve_serverkey = hub.keys.public
        forger.curve_publickey, forger.curve_secretkey = zmq.curve_keypair()
        forger.connect(hub.endpoint)
        forger.send_multipart([b"T", (1).to_bytes(4, "little"), b"E\x04\x00\x00\x00fake"])
        forger.send_multipart([b"Q", bytes(8), b"S", b"key", b"forged"])

        served = threading.Event()

        def serve() -> None:
            while not served.is_set():
                hub.poll(10)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        local, remote = LocalStore(hub.table), link.store
        link.send(b"R")
        local.set("key", b"rank0")
        assert remote.get("key") == b"rank0"
        assert remote.add("n", 2) == 2 and local.add("n", 3) == 5
        assert remote.check(["key", "n"]) and not remote.check(["missing"])
        waiter = threading.Thread(target=lambda: remote.wait(["late"], timedelta(seconds=30)))
        waiter.start()
        time.sleep(0.2)
        local.set("late", b"1")  # the parked wait is answered
        waiter.join(timeout=10)
        assert not waiter.is_alive()
        assert remote.compare_set("key", b"rank0", b"swapped") == b"swapped"
        assert remote.delete_key("late") and remote.num_keys() == 2
        with pytest.raises(LookupError):
            remote.wait(["never"], timedelta(seconds=0.3))
        # rank 0 stops waiting for a worker that has failed
        with pytest.raises(RuntimeError, match="rank 1 failed"):
            LocalStore(hub.table, lambda: "rank 1 failed").get("never")
        time.sleep(0.3)
        served.set()
        thread.join(timeout=5)
        assert statuses == [(1, b"R")]  # the forger's error never arrived
        assert hub.table.data[b"key"] == b"swapped"  # nor its write
    finally:
        ctx.destroy(linger=0)
        link.close()
        hub.close()


def test_a_bad_executor_backend_is_named():
    from asyncllm.errors import ConfigError

    with pytest.raises(ConfigError, match=r"distributed_executor_backend='rpc'.*one of mp, ray"):
        EngineArgs(distributed_executor_backend="rpc")
