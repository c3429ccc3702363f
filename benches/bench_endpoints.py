"""The APIs against each other: `asyncllm bench serving` streaming the same
prompts through /v1/chat/completions, /v1/responses and /v1/messages of one
`asyncllm serve`, in rounds that alternate the endpoints (so load on a shared
box falls on all of them alike).

    python benches/bench_endpoints.py [--model small] [--concurrency 64] [--rounds 2] [--quick]

Reported per endpoint: output tokens/s of each round and their median, and the
median's ratio to chat's (issue 30's target: responses and messages within 10 %).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_serving import free_port, wait_healthy  # noqa: E402
from models import QUICK_HELP, build_model  # noqa: E402

from asyncllm.cli.bench import bench_serving  # noqa: E402

ENDPOINTS = ("chat", "responses", "messages")
# the bench models have no chat template of their own
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-prompts", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = p.parse_args()
    if args.quick:
        args.model, args.concurrency, args.num_prompts, args.output_len = "micro", 4, 8, 8
        args.rounds = 1
    port = free_port()
    base = argparse.Namespace(
        base_url=f"http://127.0.0.1:{port}",
        model=None,
        num_prompts=args.num_prompts,
        input_len=32,
        output_len=args.output_len,
        max_concurrency=args.concurrency,
        request_rate=float("inf"),
        api_key=None,
        seed=0,
        temperature=0.0,
    )
    rates: dict[str, list[float]] = {e: [] for e in ENDPOINTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model, Path(tmp))
        cmd = [sys.executable, "-m", "asyncllm.cli", "serve", str(model)]
        cmd += ["--chat-template", TEMPLATE, "--port", str(port), "--log-level", "warning"]
        proc = subprocess.Popen(cmd)
        try:
            wait_healthy(base.base_url, proc)
            for endpoint in ENDPOINTS:  # warm each path once
                warm = argparse.Namespace(**{**vars(base), "endpoint": endpoint, "num_prompts": 1})
                asyncio.run(bench_serving(warm))
            for _ in range(args.rounds):
                for endpoint in ENDPOINTS:
                    ns = argparse.Namespace(**{**vars(base), "endpoint": endpoint})
                    result = asyncio.run(bench_serving(ns))
                    if result["failed"]:
                        raise SystemExit(f"{endpoint}: {result['first_error']}")
                    rates[endpoint].append(result["output_token_throughput"])
        finally:
            proc.terminate()
            proc.wait(60)
    chat = statistics.median(rates["chat"])
    report = {
        e: {
            "tok_s": [round(r, 1) for r in rs],
            "median": round(statistics.median(rs), 1),
            "vs_chat": round(statistics.median(rs) / chat, 3),
        }
        for e, rs in rates.items()
    }
    print(json.dumps({"model": args.model, "concurrency": args.concurrency, **report}, indent=2))


if __name__ == "__main__":
    main()
