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
    model_dir: Path, dp: int, prompts: list[list[int]], out_len: int, sampling: str
) -> dict:
    from asyncllm import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(str(model_dir), dtype="float32", data_parallel_size=dp, max_num_seqs=256) as llm:
        started = time.perf_counter()
        params = SamplingParams(max_tokens=out_len, ignore_eos=True, **SAMPLING[sampling])
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == out_len * len(prompts)
    return {"tokens_per_s": tokens / elapsed, "startup_s": started - t0}


def first_token_s(model_dir: Path, dp: int) -> float:
    from asyncllm import LLM, SamplingParams

    t0 = time.perf_counter()
    with LLM(str(model_dir), dtype="float32", data_parallel_size=dp) as llm:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=1), use_tqdm=False)
        return time.perf_counter() - t0


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
    a = ap.parse_args()
    out_len, groups, per_group = 128, 16, 16
    samplings = list(SAMPLING)
    if a.quick:  # a smoke run: every row once, greedy only
        a.models, a.repeats, a.streams, out_len, groups, per_group = ["micro"], 1, 8, 8, 2, 4
        samplings = ["greedy"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            model_dir = build_model(name, Path(tmp))
            prompts = workload(a.streams, 32)
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
