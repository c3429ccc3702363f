"""`asyncllm bench`: `serving` (an HTTP load generator against any OpenAI-compatible
server), `throughput` (offline, `LLM.generate` on a batch) and `latency` (one
batch at a time). Results print as a table, or as JSON with `--json`.

`serving` streams `/v1/completions` (or `/v1/chat/completions`) requests with
`ignore_eos` and a fixed `max_tokens`, at a Poisson `--request-rate` or a fixed
`--max-concurrency`, and reports request and token throughput with TTFT (time to
the first content chunk), TPOT (per request: (latency - TTFT) / (tokens - 1)) and
ITL (the gaps between content chunks) as mean, median and p99.

Sampling: only the parameters given (`--temperature`, `--top-p`, `--top-k`,
`--min-p`) are sent, as real clients do; unset, the server's defaults apply (the
OpenAI default temperature is 1.0). `throughput` and `latency` likewise build
`SamplingParams` from the given ones only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from asyncllm.cli.args import (
    add_engine_args,
    add_optional_sampling_args,
    engine_args_from,
    optional_sampling_args,
)

_TEXT = (
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "or has had not but what all when can there been one who their more time if will would "
    "about its out up so some into them these two may then first any new like"
)
_WORDS = _TEXT.split()


def add_parser(sub: Any) -> None:
    """`asyncllm bench` and its kinds: serving, throughput, latency, overhead."""
    p = sub.add_parser("bench", help="measure a server or the engine")
    kinds = p.add_subparsers(dest="bench", required=True)

    s = kinds.add_parser("serving", help="load-test an OpenAI-compatible server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server URL")
    s.add_argument("--model", default=None, help="model name (default: the first /v1/models)")
    s.add_argument(
        "--endpoint",
        choices=("completions", "chat", "responses", "messages"),
        default="completions",
        help="/v1/completions, /v1/chat/completions, /v1/responses or /v1/messages",
    )
    s.add_argument("--num-prompts", type=int, default=200, help="requests to send")
    s.add_argument("--input-len", type=int, default=32, help="prompt words per request")
    s.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    s.add_argument("--max-concurrency", type=int, default=64, help="requests in flight at most")
    s.add_argument(
        "--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second"
    )
    s.add_argument("--api-key", default=None, help="sent as a Bearer token")
    s.add_argument("--seed", type=int, default=0, help="seed of prompts and arrivals")
    s.add_argument("--json", action="store_true", help="print the results as JSON")
    add_optional_sampling_args(s)

    for name, text in (
        ("throughput", "offline throughput of LLM.generate"),
        ("latency", "end-to-end latency of one batch"),
    ):
        k = kinds.add_parser(name, help=text)
        add_engine_args(k)
        k.add_argument("--input-len", type=int, default=32, help="prompt tokens")
        k.add_argument("--output-len", type=int, default=128, help="tokens to generate")
        k.add_argument(
            "--num-prompts",
            type=int,
            default=256 if name == "throughput" else 1,
            help="requests (the batch size for latency)",
        )
        k.add_argument("--num-iters", type=int, default=3, help="timed repetitions")
        k.add_argument("--json", action="store_true", help="print the results as JSON")
        add_optional_sampling_args(k)

    o = kinds.add_parser(
        "overhead", help="the engine core's per-step CPU gap, with the null executor"
    )
    o.add_argument("model", help="model directory (its config and tokenizer; no weights run)")
    o.add_argument("--num-streams", type=int, default=256, help="concurrent streams")
    o.add_argument("--output-len", type=int, default=256, help="tokens per stream")
    o.add_argument(
        "--delay-ms", type=float, default=0.0, help="null executor's sleep per step (GIL free)"
    )
    o.add_argument(
        "--trace-dir",
        default=None,
        help="also write the run's Chrome trace-event timeline (both processes) here",
    )
    o.add_argument("--json", action="store_true", help="print the results as JSON")


def run(ns: argparse.Namespace) -> int:
    if ns.bench == "serving":
        results = asyncio.run(bench_serving(ns))
    elif ns.bench == "overhead":
        results = asyncio.run(bench_overhead(ns))
    else:
        results = bench_offline(ns)
    if ns.json:
        print(json.dumps(results, indent=2))
    else:
        print(format_table(results))
    return 0


# -- serving ----------------------------------------------------------------------------


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def make_prompt(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(num_words))


_URLS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}


def _read_event(endpoint: str, body: dict[str, Any]) -> tuple[str | None, int | None]:
    """(the text piece, the output tokens of a usage report) of one streamed
    event of `endpoint`."""
    if endpoint == "responses":
        kind = body.get("type")
        if kind == "response.output_text.delta":
            return body["delta"], None
        if kind in ("response.completed", "response.incomplete"):
            return None, body["response"]["usage"]["output_tokens"]
        return None, None
    if endpoint == "messages":
        kind = body.get("type")
        if kind == "content_block_delta":
            return body["delta"].get("text"), None
        if kind == "message_delta":
            return None, body["usage"]["output_tokens"]
        return None, None
    tokens = body["usage"]["completion_tokens"] if body.get("usage") else None
    choices = body.get("choices") or []
    if not choices:
        return None, tokens
    chat = endpoint == "chat"
    return (choices[0].get("delta", {}).get("content") if chat else choices[0].get("text")), tokens


async def _one_request(
    session: Any, url: str, payload: dict[str, Any], endpoint: str
) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    last = start
    try:
        async with session.post(url, json=payload) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            chunks = 0
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                piece, tokens = _read_event(endpoint, json.loads(data))
                if tokens:
                    result.output_tokens = tokens
                if not piece:
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
                chunks += 1
            result.latency = time.perf_counter() - start
            if not result.output_tokens:
                result.output_tokens = chunks
            result.ok = True
    except Exception as exc:  # a failed request is reported, not fatal to the run
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _payload(ns: argparse.Namespace, model: str, prompt: str) -> dict[str, Any]:
    """One streamed request of `ns.endpoint` for `prompt`, run to `ns.output_len`."""
    body: dict[str, Any] = {
        "model": model,
        "ignore_eos": True,
        "stream": True,
        **optional_sampling_args(ns),
    }
    if ns.endpoint == "responses":
        return {**body, "input": prompt, "max_output_tokens": ns.output_len}
    body["max_tokens"] = ns.output_len
    if ns.endpoint in ("chat", "messages"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if ns.endpoint != "messages":
        body["stream_options"] = {"include_usage": True}
    return body


async def bench_serving(ns: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    base = ns.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        headers=headers, timeout=timeout, connector=connector
    ) as session:
        model = ns.model
        if model is None:
            async with session.get(base + "/v1/models") as resp:
                model = (await resp.json())["data"][0]["id"]
        url = base + _URLS[ns.endpoint]
        rng = random.Random(ns.seed)
        prompts = [make_prompt(rng, ns.input_len) for _ in range(ns.num_prompts)]
        limit = asyncio.Semaphore(ns.max_concurrency)

        async def limited(prompt: str) -> RequestResult:
            async with limit:
                return await _one_request(session, url, _payload(ns, model, prompt), ns.endpoint)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.ensure_future(limited(prompt)))
            if ns.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(ns.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    return summarize(results, duration, ns)


def _stats(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {
        "mean": statistics.fmean(values) * scale,
        "median": statistics.median(values) * scale,
        "p99": p99 * scale,
    }


def summarize(
    results: list[RequestResult], duration: float, ns: argparse.Namespace
) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    errors = [r.error for r in results if not r.ok]
    return {
        "base_url": ns.base_url,
        "endpoint": ns.endpoint,
        "num_prompts": len(results),
        "completed": len(ok),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "max_concurrency": ns.max_concurrency,
        "sampling": optional_sampling_args(ns),
        "request_rate": None if ns.request_rate == float("inf") else ns.request_rate,
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_token_throughput": tokens / duration,
        "total_output_tokens": tokens,
        "ttft_ms": _stats([r.ttft for r in ok]),
        "tpot_ms": _stats(tpot),
        "itl_ms": _stats([x for r in ok for x in r.itl]),
        "e2e_ms": _stats([r.latency for r in ok]),
    }


# -- offline ----------------------------------------------------------------------------


def bench_offline(ns: argparse.Namespace) -> dict[str, Any]:
    from asyncllm.frontend.llm import LLM
    from asyncllm.sampling_params import SamplingParams

    args = engine_args_from(ns)
    rng = random.Random(0)
    kwargs = {f: getattr(args, f) for f in args.__dataclass_fields__ if f != "model"}
    params = SamplingParams(max_tokens=ns.output_len, ignore_eos=True, **optional_sampling_args(ns))
    times = []
    with LLM(args.model, **kwargs) as llm:
        vocab = llm.get_tokenizer().vocab_size
        prompts = [
            [rng.randrange(3, vocab) for _ in range(ns.input_len)] for _ in range(ns.num_prompts)
        ]
        llm.generate(prompts[:1], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        for _ in range(ns.num_iters):
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times.append(time.perf_counter() - start)
    best = statistics.median(times)
    num_tokens = ns.num_prompts * ns.output_len
    return {
        "bench": ns.bench,
        "model": args.model,
        "num_prompts": ns.num_prompts,
        "input_len": ns.input_len,
        "output_len": ns.output_len,
        "sampling": optional_sampling_args(ns),
        "median_s": best,
        "latencies_s": times,
        "request_throughput": ns.num_prompts / best,
        "output_token_throughput": num_tokens / best,
    }


async def bench_overhead(ns: argparse.Namespace) -> dict[str, Any]:
    """Stream `num_streams` requests through AsyncLLM with the null executor and read
    the core's own step timers: the gap is schedule + update + output hand-off, the
    CPU work between two forward passes (medians over the steady-state steps)."""
    from asyncllm.config import EngineArgs
    from asyncllm.frontend.async_llm import AsyncLLM
    from asyncllm.sampling_params import RequestOutputKind, SamplingParams

    args = EngineArgs(
        model=ns.model,
        executor="null",
        null_step_delay_ms=ns.delay_ms,
        max_num_seqs=max(256, ns.num_streams),
        max_num_batched_tokens=max(4096, 16 * ns.num_streams),
        trace_dir=getattr(ns, "trace_dir", None),
        collect_step_timings=True,
    )
    engine = AsyncLLM.from_engine_args(args)
    params = SamplingParams(
        max_tokens=ns.output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    vocab = engine.tokenizer.vocab_size

    async def stream(i: int) -> None:
        prompt = [3 + (i * 16 + j) % (vocab - 3) for j in range(16)]
        async for _ in engine.generate(prompt, params, f"overhead-{i}"):
            pass

    try:
        await engine.call_utility("get_step_timings", {"clear": True})
        start = time.perf_counter()
        await asyncio.gather(*(stream(i) for i in range(ns.num_streams)))
        elapsed = time.perf_counter() - start
        timings = await engine.call_utility("get_step_timings")
    finally:
        engine.shutdown()
    # steady state: steps that decoded at least 90 % of the largest batch seen (the
    # streams reach the core over a few steps and leave over a few more)
    outputs = timings["num_outputs"]
    if not outputs:
        raise RuntimeError("the engine core recorded no steps")
    full = 0.9 * max(outputs)
    steady = [i for i, n in enumerate(outputs) if n >= full]

    def med_us(key: str) -> float:
        return 1e6 * statistics.median(timings[key][i] for i in steady)

    handoff = 1e6 * statistics.median(timings["handoff"]) if timings["handoff"] else 0.0
    gap = 1e6 * statistics.median(timings["schedule"][i] + timings["update"][i] for i in steady)
    num_steps = len(timings["num_outputs"])
    return {
        "bench": "overhead",
        "num_streams": ns.num_streams,
        "output_len": ns.output_len,
        "delay_ms": ns.delay_ms,
        "steady_steps": len(steady),
        "schedule_us": med_us("schedule"),
        "execute_us": med_us("execute"),
        "update_us": med_us("update"),
        "handoff_us": handoff,
        "gap_us": gap + handoff,
        "steps_per_s": num_steps / elapsed,
        "output_token_throughput": ns.num_streams * ns.output_len / elapsed,
        "trace_dir": args.trace_dir,
    }


def format_table(results: dict[str, Any]) -> str:
    lines = []
    for key, value in results.items():
        if key == "sampling":
            given = ", ".join(f"{k} {v}" for k, v in value.items())
            lines.append(f"{key:<26} {given or 'defaults (none sent)'}")
        elif isinstance(value, dict):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in value.items())
            lines.append(f"{key:<26} {parts}")
        elif isinstance(value, float):
            lines.append(f"{key:<26} {value:.3f}")
        elif isinstance(value, list):
            lines.append(f"{key:<26} {', '.join(f'{v:.3f}' for v in value)}")
        else:
            lines.append(f"{key:<26} {value}")
    return "\n".join(lines)
