"""Scale-out on one machine: data parallelism against one engine core, and
prefix-aware routing against least-loaded routing, in one run.

    python benches/bench_parallel.py [--models micro small] [--repeats 3] [--quick]

Rows (fixed seed, every output ignores EOS):
  offline   `LLM` with data_parallel_size 1 and 2, 256 x 32 -> 128, greedy and
            sampled (temperature 1.0, top_p 0.95), alternating; tokens/s and the
            ratio DP=2 / DP=1 (median of per-pair ratios). On a 2-core machine
            each core gets one torch thread: expect no speed-up, the row records
            what the second process costs.
  startup   seconds from `LLM(...)` to the first token, DP=1 and DP=2.
  tp-comm   tensor parallelism's per-step costs on gloo, two real processes:
            the step message of a 256-request decode step, 8 and 32 KV blocks
            per request (rank 0's send; and step_nb*_us: the round trip to a
            worker that decodes it, less a bare round trip), and one all-reduce
            of [tokens, hidden] float32 (the model runs two per layer)
  tp-offline  `LLM` with tensor_parallel_size 1 and 2, one torch thread per
            rank, greedy: tokens/s and the ratio TP=2 / TP=1
  tp-startup  seconds from `LLM(...)` to the first token with TP=2, multiprocess
            and over Ray (`--distributed-executor-backend ray`, a one-node cluster
            started first; no Ray row without Ray), alternating (not with --quick)
  prefix    DP=2 serving 16 system prompts (256 tokens each) x 16 requests
            through `AsyncLLM`: one request per prompt first, then the other 15
            of each arriving together, prompt after prompt; the second wave's
            prefix-cache hit rate and tokens/s, least-loaded against
            prefix-aware routing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import QUICK_HELP, build_model  # noqa: E402

SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.95)}


def workload(num: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (prompt_len,), generator=g).tolist() for _ in range(num)]


def offline(
    model_dir: Path, dp: int, prompts: list[list[int]], out_len: int, sampling: str, **kw: Any
) -> dict:
    from asyncllm import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(str(model_dir), dtype="float32", data_parallel_size=dp, max_num_seqs=256, **kw) as llm:
        started = time.perf_counter()
        params = SamplingParams(max_tokens=out_len, ignore_eos=True, **SAMPLING[sampling])
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == out_len * len(prompts)
    return {"tokens_per_s": tokens / elapsed, "startup_s": started - t0}


def first_token_s(model_dir: Path, dp: int, tp: int = 1, backend: str = "mp") -> float:
    from asyncllm import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(
        str(model_dir),
        dtype="float32",
        data_parallel_size=dp,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
    ) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
        return time.perf_counter() - t0


def _decode_step(n: int, nb: int, bs: int = 16) -> tuple:
    """The step message's arrays for `n` decodes reading `nb` blocks each."""
    import numpy as np

    ctx = np.full(n, nb * bs - 1, dtype=np.int32)
    table = np.arange(n * nb, dtype=np.int32).reshape(n, nb)
    slots = table[:, -1].astype(np.int64) * bs + bs - 1
    ids = np.arange(n, dtype=np.int32)
    return (
        ids,
        ctx.astype(np.int64),
        np.ones(n, dtype=np.int32),
        ctx,
        table,
        slots,
        ids.astype(np.int64),
    )


def _comm_rank(rank: int, store: str, iters: int, hidden: int, results: Any) -> None:
    """One rank of the tp-comm row (rank 1 in a spawned process): rank 0 puts
    medians in µs on `results`; rank 1 checks that each message arrives intact."""
    import numpy as np
    import torch.distributed as dist

    from asyncllm.executor.distributed import close_group, init_group, loopback_interface
    from asyncllm.executor.step_channel import StepReceiver, StepSender

    torch.set_num_threads(1)
    group = init_group(dist.FileStore(store, 2), rank, 2, "cpu", loopback_interface())
    tiny = torch.zeros(1)
    sender = StepSender(group, hidden, torch.float32)
    receiver = StepReceiver(group, hidden, torch.float32)
    timings: dict[str, list[float]] = {"bare_round_trip": []}
    # ~128 tokens of context each (the payload rides in the header's message),
    # and ~512 (too big for it: a second broadcast)
    for nb in (8, 32):
        step = _decode_step(256, nb)
        spent = timings[f"step_nb{nb}_send"] = []
        trips = timings[f"step_nb{nb}_round_trip"] = []
        for i in range(2 * iters):  # the first half warms up
            t0 = time.perf_counter()
            if rank == 0:
                sender.send_step(*step, False)
            else:
                got = receiver.recv_step(receiver.recv_header())
                if i == 0:
                    # (the LoRA map and events that follow are empty here)
                    sent = got[: len(step)]
                    assert all(np.array_equal(a, b) for a, b in zip(sent, step, strict=True))
            t1 = time.perf_counter()
            dist.all_reduce(tiny)
            t2 = time.perf_counter()
            dist.all_reduce(tiny)
            t3 = time.perf_counter()
            if i >= iters:
                spent.append(t1 - t0)
                trips.append(t2 - t0)
                timings["bare_round_trip"].append(t3 - t2)
    for tokens in (1, 256):
        x = torch.randn(tokens, hidden)
        spent = timings[f"all_reduce_{tokens}x{hidden}"] = []
        for i in range(2 * iters):
            t0 = time.perf_counter()
            dist.all_reduce(x)
            if i >= iters:
                spent.append(time.perf_counter() - t0)
    close_group()
    if rank == 0:
        us = {k: median(v) * 1e6 for k, v in timings.items()}
        for nb in (8, 32):  # what the message adds to a round trip
            us[f"step_nb{nb}_us"] = us.pop(f"step_nb{nb}_round_trip") - us["bare_round_trip"]
        results.put(us)


def tp_comm(iters: int, hidden: int) -> dict:
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        worker = ctx.Process(target=_comm_rank, args=(1, store, iters, hidden, results))
        worker.start()
        _comm_rank(0, store, iters, hidden, results)
        worker.join()
    return {k: round(v, 1) for k, v in results.get().items()}


def tp_rows(
    model_dir: Path, name: str, prompts: list[list[int]], out_len: int, repeats: int, startup: bool
) -> list[dict]:
    rows: list[dict[str, Any]] = []
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for _ in range(repeats):
        for tp in (1, 2):
            kw = dict(tensor_parallel_size=tp, num_threads=1)
            runs[tp].append(offline(model_dir, 1, prompts, out_len, "greedy", **kw))
    row: dict[str, Any] = {"row": "tp-offline", "model": name, "sampling": "greedy"}
    for tp in (1, 2):
        row[f"tp{tp}_tok_s"] = median(r["tokens_per_s"] for r in runs[tp])
    row["tp2_over_tp1"] = median(
        b["tokens_per_s"] / a["tokens_per_s"] for a, b in zip(runs[1], runs[2], strict=True)
    )
    rows.append(row)
    if startup:
        rows.append(tp_startup(model_dir, name, repeats))
    else:
        print("tp-startup (multiprocess and Ray): skipped under --quick", file=sys.stderr)
    return rows


def tp_startup(model_dir: Path, name: str, repeats: int) -> dict[str, Any]:
    """TP=2 start-up to the first token, multiprocess and (alternating) over a
    one-node Ray cluster started here beforehand, as a served one would be."""
    backends = ["mp"]
    row: dict[str, Any] = {"row": "tp-startup", "model": name}
    try:
        import ray
    except ImportError:
        print("tp-startup: Ray is not installed, no Ray row", file=sys.stderr)
        row["ray"] = "not installed"
    else:
        if not ray.is_initialized():  # "local": a new instance, not whatever ran last here
            ray.init(address="local", include_dashboard=False, log_to_driver=False)
        backends.append("ray")
    times: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(repeats):
        for backend in backends:
            times[backend].append(first_token_s(model_dir, 1, tp=2, backend=backend))
    row["tp2_s"] = median(times["mp"])
    if "ray" in times:
        row["tp2_ray_s"] = median(times["ray"])
    return row


async def _prefix_run(model_dir: Path, prefix_aware: bool, groups: int, per_group: int) -> dict:
    from asyncllm import AsyncLLM, EngineArgs, SamplingParams

    args = EngineArgs(
        model=str(model_dir),
        dtype="float32",
        data_parallel_size=2,
        prefix_aware_routing=prefix_aware,
        max_num_seqs=256,
    )
    engine = AsyncLLM.from_engine_args(args)
    systems = workload(groups, 256, seed=3)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)

    async def one(g: int, i: int) -> int:
        prompt = [*systems[g], 7 + i, 11 + g]
        n = 0
        async for out in engine.generate({"prompt_token_ids": prompt}, params, f"p{g}-{i}"):
            n = len(out.outputs[0].token_ids)
        return n

    try:
        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(g, i) for i in range(per_group) for g in range(groups)))
        elapsed = time.perf_counter() - t0
        stats = await engine.get_stats()
    finally:
        engine.shutdown()
    return {
        "hit_rate": stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]),
        "tokens_per_s": sum(counts) / elapsed,
        "per_core_requests": [s["queue_time_cumulative"][-1] for s in stats["engines"]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["micro", "small"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    ap.add_argument("--only", choices=["dp", "tp"], help="only the data- or tensor-parallel rows")
    a = ap.parse_args()
    out_len, groups, per_group = 128, 16, 16
    samplings = list(SAMPLING)
    if a.quick:  # a smoke run: every row once, greedy only
        a.models, a.repeats, a.streams, out_len, groups, per_group = ["micro"], 1, 8, 8, 2, 4
        samplings = ["greedy"]
    rows: list[dict[str, Any]] = []
    if a.only != "dp":
        row = {
            "row": "tp-comm",
            "requests": 256,
            "hidden": 512,
            **tp_comm(20 if a.quick else 300, 512),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            model_dir = build_model(name, Path(tmp))
            prompts = workload(a.streams, 32)
            if a.only != "dp":
                for row in tp_rows(model_dir, name, prompts, out_len, a.repeats, not a.quick):
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if a.only == "tp":
                continue
            for sampling in samplings:
                runs: dict[int, list[dict]] = {1: [], 2: []}
                for _ in range(a.repeats):
                    for dp in (1, 2):
                        runs[dp].append(offline(model_dir, dp, prompts, out_len, sampling))
                row = {"row": "offline", "model": name, "sampling": sampling}
                for dp in (1, 2):
                    row[f"dp{dp}_tok_s"] = median(r["tokens_per_s"] for r in runs[dp])
                row["dp2_over_dp1"] = median(
                    b["tokens_per_s"] / a_["tokens_per_s"]
                    for a_, b in zip(runs[1], runs[2], strict=True)
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
            startup = {
                dp: median(first_token_s(model_dir, dp) for _ in range(a.repeats)) for dp in (1, 2)
            }
            row = {"row": "startup", "model": name, "dp1_s": startup[1], "dp2_s": startup[2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            for prefix_aware in (False, True):
                res = [
                    asyncio.run(_prefix_run(model_dir, prefix_aware, groups, per_group))
                    for _ in range(a.repeats)
                ]
                row = {
                    "row": "prefix",
                    "model": name,
                    "routing": "prefix-aware" if prefix_aware else "least-loaded",
                    "hit_rate": median(r["hit_rate"] for r in res),
                    "tok_s": median(r["tokens_per_s"] for r in res),
                    "per_core_requests": res[0]["per_core_requests"],
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
