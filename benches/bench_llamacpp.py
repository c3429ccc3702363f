"""asyncllm against llama.cpp on llama.cpp's own file: SmolLM2-135M-Instruct Q4_1,
one request, decode (greedy and sampled) and a long prompt's prefill, the same
number of threads.

    python benches/bench_llamacpp.py [--rounds 5] [--tokens 128] [--prompt-tokens 512]
                                     [--streams 16] [--quick]

llama.cpp runs through llama-cpp-python (`pip install asyncllm[bench]`, built for
this CPU from its source; without it only asyncllm's rows are printed). Both get
the same token ids. Decode: the time per token of `--tokens` new tokens beyond
the first (time(N tokens) - time(1 token), over N - 1), EOS banned; sampled rows
draw at temperature 1.0, top_p 0.95 (llama.cpp's other samplers off: top_k 0,
min_p 0, no repeat penalty). Prefill: a `--prompt-tokens` prompt and one new
token. Neither reuses an earlier call's KV cache (llama.cpp's is reset, asyncllm's
prefix caching is off). The engines alternate round by round; medians, and the
median of per-round ratios.

Then `--streams` concurrent requests through `asyncllm serve` on the same file
(`asyncllm bench serving`: 32-word prompts, `--tokens` tokens each, EOS ignored,
greedy and sampled), as output tokens/s against llama.cpp's batch-1 decode rate
(1000 / its median ms a token): what a server gives many users at once against
what llama.cpp's Python binding gives one.

The issue's targets (issue 28): batch-1 decode and prefill ahead of llama.cpp on
its own file; `--streams 16` through the server at least 4x llama.cpp's batch-1
tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))
from bench_roofline import machine_header  # noqa: E402
from bench_serving import SAMPLING, free_port, wait_healthy  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.cli.bench import bench_serving  # noqa: E402

TEXT = (
    "The history of the printing press begins in the fifteenth century, when "
    "movable type changed how books were made, sold and read across Europe. "
)


class Ours:
    name = "asyncllm"

    def __init__(self, path: Path) -> None:
        self.llm = LLM(
            model=str(path), dtype="float32", max_model_len=1024, enable_prefix_caching=False
        )

    def run(self, ids: list[int], tokens: int, sampled: bool) -> float:
        params = SamplingParams(
            max_tokens=tokens,
            ignore_eos=True,
            temperature=1.0 if sampled else 0.0,
            top_p=0.95 if sampled else 1.0,
            seed=0,
        )
        t0 = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == tokens
        return time.perf_counter() - t0

    def close(self) -> None:
        self.llm.shutdown()


class LlamaCpp:
    name = "llama.cpp"

    def __init__(self, path: Path, threads: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(
            model_path=str(path),
            n_ctx=1024,
            n_batch=512,
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
            seed=0,
        )
        self.eos = self.llm.token_eos()

    def run(self, ids: list[int], tokens: int, sampled: bool) -> float:
        self.llm.reset()  # no KV reuse from the last call
        t0 = time.perf_counter()
        out: Any = self.llm.create_completion(
            ids,
            max_tokens=tokens,
            temperature=1.0 if sampled else 0.0,
            top_p=0.95 if sampled else 1.0,
            top_k=0,
            min_p=0.0,
            repeat_penalty=1.0,
            logit_bias={self.eos: float("-inf")},
        )
        elapsed = time.perf_counter() - t0
        assert out["usage"]["completion_tokens"] == tokens, out["usage"]
        return elapsed

    def close(self) -> None:
        self.llm.close()


def serve_rates(path: Path, streams: int, tokens: int, rounds: int) -> dict[str, list[float]]:
    """Output tokens/s of `streams` concurrent requests (2 x streams in all) through
    `asyncllm serve`, greedy and sampled alternating, `rounds` times each."""
    port = free_port()
    base = argparse.Namespace(
        base_url=f"http://127.0.0.1:{port}",
        model=None,
        endpoint="completions",
        num_prompts=2 * streams,
        input_len=32,
        output_len=tokens,
        max_concurrency=streams,
        request_rate=float("inf"),
        api_key=None,
        seed=0,
    )
    cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(path), "--max-model-len", "1024"]
    proc = subprocess.Popen([*cmd, "--port", str(port), "--log-level", "warning"])
    rates: dict[str, list[float]] = {kind: [] for kind in SAMPLING}
    try:
        wait_healthy(base.base_url, proc)
        asyncio.run(bench_serving(argparse.Namespace(**{**vars(base), "num_prompts": streams})))
        for _ in range(rounds):
            for kind, sampling in SAMPLING.items():
                ns = argparse.Namespace(**{**vars(base), **sampling})
                result = asyncio.run(bench_serving(ns))
                assert result["failed"] == 0, result
                rates[kind].append(result["output_token_throughput"])
        print({kind: [f"{r:.1f}" for r in v] for kind, v in rates.items()}, flush=True)
    finally:
        proc.terminate()
        proc.wait(60)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests to the server")
    ap.add_argument(
        "--quick", action="store_true", help="1 round, 8 tokens, a 64-token prompt, 4 streams"
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.prompt_tokens, args.streams = 1, 8, 64, 4
    threads = torch.get_num_threads()
    print(machine_header(), f"threads {threads}", flush=True)
    path = fetch()
    ours = Ours(path)
    tok = ours.llm.get_tokenizer()
    short = tok.encode(TEXT)[:24]
    long = (tok.encode(TEXT * 64))[: args.prompt_tokens]
    engines: list[Any] = [ours]
    try:
        engines.append(LlamaCpp(path, threads))
    except ImportError:
        print("llama-cpp-python not installed (pip install asyncllm[bench]): no baseline")
    cells = {
        "decode greedy (ms/token)": (short, False, True),
        "decode sampled (ms/token)": (short, True, True),
        f"prefill {len(long)} tokens (ms)": (long, False, False),
    }
    times: dict[str, dict[str, list[float]]] = {c: {} for c in cells}
    for engine in engines:  # warm-up: first calls pay one-off costs
        engine.run(short, 4, False)
        engine.run(long, 1, False)
    for r in range(args.rounds):
        for cell, (ids, sampled, per_token) in cells.items():
            for engine in engines if r % 2 == 0 else engines[::-1]:
                if per_token:
                    t1 = engine.run(ids, 1, sampled)
                    tn = engine.run(ids, args.tokens, sampled)
                    value = (tn - t1) / (args.tokens - 1) * 1e3
                else:
                    value = engine.run(ids, 1, sampled) * 1e3
                times[cell].setdefault(engine.name, []).append(value)
        print(r, {c: {e: f"{v[-1]:.2f}" for e, v in by.items()} for c, by in times.items()})
    for engine in engines:
        engine.close()
    served = serve_rates(path, args.streams, args.tokens, max(1, args.rounds // 2))
    print("\n| measure | asyncllm | llama.cpp | llama.cpp / asyncllm (>1: asyncllm faster) |")
    print("|---|---:|---:|---:|")
    for cell, by in times.items():
        ours_t = by["asyncllm"]
        theirs = by.get("llama.cpp")
        if theirs is None:
            print(f"| {cell} | {median(ours_t):.2f} | – | – |")
            continue
        ratio = median(b / a for a, b in zip(ours_t, theirs, strict=True))
        print(f"| {cell} | {median(ours_t):.2f} | {median(theirs):.2f} | {ratio:.2f} |")
    print(f"\n| {args.streams} streams via serve | tokens/s | / llama.cpp batch-1 tokens/s |")
    print("|---|---:|---:|")
    for kind, rates in served.items():
        cell = f"decode {kind} (ms/token)"
        theirs = times[cell].get("llama.cpp")
        ratio = f"{median(rates) / (1e3 / median(theirs)):.2f}" if theirs else "–"
        print(f"| {kind} | {median(rates):.1f} | {ratio} |")


if __name__ == "__main__":
    main()
