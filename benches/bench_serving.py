"""The HTTP layer's cost: `asyncllm bench serving` against `asyncllm serve`, and the
same workload on `AsyncLLM` in-process, with the same model and prompts.

    python benches/bench_serving.py [--model small] [--concurrency 64] [--num-prompts 128] [--quick]

Both sides stream every request (128 output tokens, EOS ignored) with at most
`--concurrency` in flight, and time TTFT / ITL / TPOT the same way: from the
request's start to each output that carries text. Each side runs twice, greedy
(temperature 0) and sampled (temperature 1.0, top_p 0.95, as real clients
sample), alternating; reported: HTTP / in-process per sampling, and sampled /
greedy per side (issue 11's target for the server: >= 0.90).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import QUICK_HELP, build_model  # noqa: E402

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams  # noqa: E402
from asyncllm.cli.args import optional_sampling_args  # noqa: E402
from asyncllm.cli.bench import RequestResult, bench_serving, make_prompt, summarize  # noqa: E402

SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.95)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the server did not start")


async def in_process(model: Path, ns: argparse.Namespace) -> dict:  # type: ignore[type-arg]
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(model)))
    rng = random.Random(ns.seed)
    prompts = [make_prompt(rng, ns.input_len) for _ in range(ns.num_prompts)]
    limit = asyncio.Semaphore(ns.max_concurrency)

    async def one(i: int, prompt: str) -> RequestResult:
        params = SamplingParams(
            max_tokens=ns.output_len,
            ignore_eos=True,
            output_kind=RequestOutputKind.DELTA,
            **optional_sampling_args(ns),
        )
        r = RequestResult()
        async with limit:
            start = last = time.perf_counter()
            async for out in engine.generate(prompt, params, f"r{i}"):
                r.output_tokens += len(out.outputs[0].token_ids)
                if not out.outputs[0].text:
                    continue
                now = time.perf_counter()
                if r.ttft == 0.0:
                    r.ttft = now - start
                else:
                    r.itl.append(now - last)
                last = now
            r.latency = time.perf_counter() - start
            r.ok = True
        return r

    try:
        await one(-1, "warm up")
        start = time.perf_counter()
        results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return summarize(list(results), time.perf_counter() - start, ns)
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = p.parse_args()
    if args.quick:
        args.model, args.concurrency, args.num_prompts, args.output_len = "micro", 4, 8, 8
    ns = argparse.Namespace(
        base_url="",
        model=None,
        endpoint="completions",
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.concurrency,
        request_rate=float("inf"),
        api_key=None,
        seed=0,
    )
    sampled = {k: argparse.Namespace(**{**vars(ns), **v}) for k, v in SAMPLING.items()}
    keys = ("output_token_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "failed")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model, Path(tmp))
        port = free_port()
        for v in sampled.values():
            v.base_url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(model)]
        proc = subprocess.Popen([*cmd, "--port", str(port), "--log-level", "warning"])
        http = {}
        try:
            wait_healthy(sampled["greedy"].base_url, proc)
            warm = argparse.Namespace(**{**vars(sampled["greedy"]), "num_prompts": 1})
            asyncio.run(bench_serving(warm))
            for kind, kns in sampled.items():
                http[kind] = asyncio.run(bench_serving(kns))
        finally:
            proc.terminate()
            proc.wait(60)
        local = {kind: asyncio.run(in_process(model, kns)) for kind, kns in sampled.items()}
    both = {
        kind: {
            "http": {k: http[kind][k] for k in keys},
            "in_process": {k: local[kind][k] for k in keys},
        }
        for kind in SAMPLING
    }
    print(json.dumps(both, indent=1))
    tput = "output_token_throughput"
    for kind in SAMPLING:
        ratio = http[kind][tput] / local[kind][tput]
        print(f"{kind}: HTTP / in-process output throughput: {ratio:.3f}")
    for side, runs in (("HTTP", http), ("in-process", local)):
        ratio = runs["sampled"][tput] / runs["greedy"][tput]
        print(f"{side}: sampled / greedy output throughput: {ratio:.3f}")


if __name__ == "__main__":
    main()
