"""Threads and placement: which engine-core settings serve best on this machine.

    python benches/bench_threads.py [--model small] [--rounds 3] [--quick]

Candidates (every combination; pinning only where it leaves a CPU to the front end):
  threads   the runner's torch threads (`--num-threads`): 1 and the CPU count
  pin       the engine core's threads (busy loop, IO threads, OpenMP team) pinned to
            the last `threads` CPUs and the server's to the others (`--pin-threads`)
  wait      the OpenMP wait policy of the core: libgomp's default (spin, then
            sleep) or OMP_WAIT_POLICY=PASSIVE (sleep at once), set in the core's
            environment before torch loads (`--omp-wait-policy inherit|passive`)

For each, against `asyncllm serve` on the same model: end-to-end latency p50/p99 of
short requests (32-word prompt, 16 tokens) one at a time and 8 at a time, and
output tokens/s with 64 streams (64 tokens each); offline (`LLM.generate`, the
same 64 x 64) tokens/s; and `AsyncLLM` used as a library, in-process (the core in a
thread of the caller) and with its core process: 64 streams of 128 tokens, output
tokens/s and inter-token latency p50/p99.

`--library` measures only the library entry points, with each candidate and with
no settings at all ("defaults": what `LLM()` and `AsyncLLM` pick by themselves),
so the table shows whether the defaults match the best candidate.

Rounds interleave the candidates, so load from elsewhere hits them alike; every
figure is the median over rounds. The table ends with each column's best candidate.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import free_port, wait_healthy  # noqa: E402
from models import QUICK_HELP, build_model  # noqa: E402

from asyncllm.cli.bench import bench_serving  # noqa: E402


@dataclass(frozen=True)
class Candidate:
    threads: int
    pin: bool
    passive: bool

    @property
    def name(self) -> str:
        pin = "pinned" if self.pin else "unpinned"
        return f"{self.threads} thr, {pin}, {'passive' if self.passive else 'default'} wait"

    def flags(self) -> list[str]:
        return [
            "--num-threads",
            str(self.threads),
            "--pin-threads" if self.pin else "--no-pin-threads",
            "--omp-wait-policy",
            "passive" if self.passive else "inherit",
        ]


def candidates(cpus: int) -> list[Candidate]:
    out = []
    for threads in sorted({1, cpus}):
        for passive in (False, True):
            for pin in (False, True) if threads < cpus else (False,):
                out.append(Candidate(threads, pin, passive))
    return out


def serving_ns(url: str, n: int, conc: int, input_len: int, output_len: int) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=url,
        model=None,
        endpoint="completions",
        num_prompts=n,
        input_len=input_len,
        output_len=output_len,
        max_concurrency=conc,
        request_rate=float("inf"),
        api_key=None,
        seed=0,
        temperature=0.0,
    )


def serve_run(model: Path, cand: Candidate, sizes: dict[str, int]) -> dict[str, float]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(model), "--port", str(port)]
    proc = subprocess.Popen([*cmd, *cand.flags(), "--log-level", "warning"])
    try:
        wait_healthy(url, proc)
        asyncio.run(bench_serving(serving_ns(url, 2, 1, 32, 16)))  # warm
        c1 = asyncio.run(bench_serving(serving_ns(url, sizes["c1"], 1, 32, 16)))
        c8 = asyncio.run(bench_serving(serving_ns(url, sizes["c8"], 8, 32, 16)))
        c64 = asyncio.run(bench_serving(serving_ns(url, sizes["c64"], 64, 32, sizes["out"])))
    finally:
        proc.terminate()
        proc.wait(60)
    for r in (c1, c8, c64):
        if r["failed"]:
            raise SystemExit(f"{cand.name}: {r['failed']} requests failed: {r['first_error']}")
    return {
        "c1_p50": c1["e2e_ms"]["median"],
        "c1_p99": c1["e2e_ms"]["p99"],
        "c8_p50": c8["e2e_ms"]["median"],
        "c8_p99": c8["e2e_ms"]["p99"],
        "c64_tps": c64["output_token_throughput"],
    }


def offline_run(model: Path, cand: Candidate, sizes: dict[str, int]) -> float:
    from asyncllm import LLM, SamplingParams

    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=sizes["out"], ignore_eos=True)
    with LLM(
        str(model),
        num_threads=cand.threads,
        pin_threads=cand.pin,
        omp_wait_policy="passive" if cand.passive else "inherit",
    ) as llm:
        vocab = llm.get_tokenizer().vocab_size
        prompts = [[rng.randrange(3, vocab) for _ in range(32)] for _ in range(sizes["c64"])]
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def async_run(
    model: Path, cand: Candidate | None, multiprocess: bool, sizes: dict[str, int]
) -> dict[str, float]:
    """`AsyncLLM` as a library: 64 concurrent streams (DELTA outputs), tokens/s and
    the gaps between a stream's outputs. `cand` None: no thread settings."""
    from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

    settings: dict[str, Any] = {}
    if cand is not None:
        settings = {
            "num_threads": cand.threads,
            "pin_threads": cand.pin and multiprocess,
            "omp_wait_policy": "passive" if cand.passive else "inherit",
        }
    engine = AsyncLLM(EngineArgs(model=str(model), **settings), multiprocess=multiprocess)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=sizes["stream"],
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )
    gaps: list[float] = []
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size

    async def stream(i: int) -> int:
        prompt = {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(32)]}
        last, n = None, 0
        async for out in engine.generate(prompt, params, request_id=f"s{i}"):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
            n += len(out.outputs[0].token_ids)
        return n

    async def main() -> float:
        await asyncio.gather(*(stream(-1 - i) for i in range(2)))  # warm
        gaps.clear()
        start = time.perf_counter()
        counts = await asyncio.gather(*(stream(i) for i in range(sizes["c64"])))
        return sum(counts) / (time.perf_counter() - start)

    try:
        tps = asyncio.run(main())
    finally:
        engine.shutdown()
    gaps.sort()
    if not gaps:  # every stream's tokens came in one delta (a short --quick run): no gaps
        return {"tps": tps, "itl_p50": math.nan, "itl_p99": math.nan}
    return {
        "tps": tps,
        "itl_p50": 1e3 * gaps[len(gaps) // 2],
        "itl_p99": 1e3 * gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
    }


def library_main(model: Path, cands: list[Candidate], rounds: int, sizes: dict[str, int]) -> None:
    """`--library`: AsyncLLM in-process and multiprocess, each candidate and defaults."""
    named: list[tuple[str, Candidate | None]] = [("defaults", None)]
    named += [(c.name, c) for c in cands]
    # every setting in-process and multiprocess, but a pinned one multiprocess only:
    # a core in a thread of this process cannot be pinned apart from it
    runs = [
        (name, cand, mp)
        for name, cand in named
        for mp in (False, True)
        if mp or cand is None or not cand.pin
    ]
    rows: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        # the order reversed every other round (as `bench_quant.py`'s rows): in a
        # fixed order each setting had the same place and neighbours every round
        for name, cand, mp in runs if r % 2 == 0 else runs[::-1]:
            res = async_run(model, cand, mp, sizes)
            key = f"{'multiprocess' if mp else 'in-process'}: {name}"
            for k, v in res.items():
                rows.setdefault(key, {}).setdefault(k, []).append(v)
            print(
                f"round {r + 1} {key}: {res['tps']:.0f} tok/s, "
                f"itl p50 {res['itl_p50']:.1f} ms p99 {res['itl_p99']:.1f} ms"
            )
            sys.stdout.flush()
    print("\n| AsyncLLM, 64 streams | tok/s | itl p50 ms | itl p99 ms | p99 / p50 | tok/s / best |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode in ("in-process", "multiprocess"):
        med = {
            k: {m: median(v) for m, v in r.items()} for k, r in rows.items() if k.startswith(mode)
        }
        best = max(m["tps"] for m in med.values())
        for key, m in med.items():
            print(
                f"| {key} | {m['tps']:.0f} | {m['itl_p50']:.1f} | {m['itl_p99']:.1f} | "
                f"{m['itl_p99'] / m['itl_p50']:.2f} | {m['tps'] / best:.2f} |"
            )
    sys.stdout.flush()


COLUMNS = (
    ("c1_p50", "conc 1 p50 ms", min),
    ("c1_p99", "conc 1 p99 ms", min),
    ("c8_p50", "conc 8 p50 ms", min),
    ("c8_p99", "conc 8 p99 ms", min),
    ("c64_tps", "64 streams tok/s", max),
    ("offline_tps", "offline tok/s", max),
)


def print_table(rows: dict[Candidate, dict[str, list[float]]]) -> None:
    print("\n| candidate | " + " | ".join(label for _, label, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    med = {c: {k: median(v) for k, v in r.items()} for c, r in rows.items()}
    for cand, m in med.items():
        cells = " | ".join(f"{m[key]:.1f}" for key, _, _ in COLUMNS)
        print(f"| {cand.name} | {cells} |")
    best = " | ".join(
        best_fn(med, key=lambda c, k=key: med[c][k]).name  # type: ignore[call-arg]
        for key, _, best_fn in COLUMNS
    )
    print(f"| **best** | {best} |")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--rounds", type=int, default=3, help="rounds; figures are their medians")
    p.add_argument("--model-dir", default=None, help="where the benchmark model is built")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    p.add_argument("--library", action="store_true", help="AsyncLLM as a library only")
    args = p.parse_args()
    sizes = {"c1": 24, "c8": 48, "c64": 64, "out": 64, "stream": 128}
    own_cpus = os.sched_getaffinity(0)
    cpus = len(own_cpus)
    cands = candidates(cpus)
    if args.quick:
        args.model, args.rounds = "micro", 1
        sizes = {"c1": 2, "c8": 8, "c64": 8, "out": 4, "stream": 4}
        cands = [Candidate(1, cpus > 1, True)]
    uptime = os.getloadavg()
    print(f"{cpus} CPUs, load average {uptime[0]:.2f} {uptime[1]:.2f} {uptime[2]:.2f}")
    rows: dict[Candidate, dict[str, list[float]]] = {c: {} for c in cands}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model, Path(args.model_dir or tmp))
        if args.library:
            library_main(model, cands, args.rounds, sizes)
            return
        for r in range(args.rounds):
            for cand in cands:
                result: dict[str, Any] = serve_run(model, cand, sizes)
                result["offline_tps"] = offline_run(model, cand, sizes)
                if os.sched_getaffinity(0) != own_cpus:  # pinning must end with the engine
                    raise SystemExit(f"{cand.name}: the front end's CPUs were not restored")
                for key, value in result.items():
                    rows[cand].setdefault(key, []).append(value)
                figures = ", ".join(f"{k} {v:.1f}" for k, v in result.items())
                print(f"round {r + 1} {cand.name}: {figures}")
                sys.stdout.flush()
            print_table(rows)
    load = os.getloadavg()
    print(f"load average at the end {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
