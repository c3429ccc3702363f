"""The soak driver the abuse tests and benches/bench_abuse.py share: thousands of
short requests at a fixed concurrency, each with a fate drawn from a seeded
random generator (read to the end, disconnect mid-stream, cancelled at a random
moment, dropped halfway through its body, or refused as bad input), and what the
server looked like afterwards.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field

from abuse_http import (
    HOST,
    iter_body,
    open_server_sockets,
    read_head,
    request_head,
    resident_kib,
    sse_payloads,
    wait_idle,
)

# fate -> weight
FATES = {
    "complete": 60,
    "disconnect mid-stream": 15,
    "cancel at a random moment": 15,
    "drop mid-body": 5,
    "bad input": 5,
}
WARMUP_REQUESTS = 200  # resident memory is compared with its level after these


@dataclass
class SoakResult:
    requests: int = 0
    fates: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)  # "200", "400", ..., "none"
    incomplete: list[str] = field(default_factory=list)  # completed fates cut short
    rss_after_warmup_kib: int = 0
    rss_end_kib: int = 0
    seconds: float = 0.0
    final_metrics: dict[str, float] = field(default_factory=dict)
    open_sockets: list[str] = field(default_factory=list)

    @property
    def rss_growth(self) -> float:
        return self.rss_end_kib / self.rss_after_warmup_kib - 1.0

    def summary(self) -> dict[str, object]:
        m = self.final_metrics
        return {
            "requests": self.requests,
            "seconds": round(self.seconds, 1),
            "fates": dict(self.fates),
            "statuses": dict(sorted(self.statuses.items())),
            "incomplete": len(self.incomplete),
            "running_after": m.get("asyncllm:num_requests_running"),
            "waiting_after": m.get("asyncllm:num_requests_waiting"),
            "kv_cache_usage_after": m.get("asyncllm:kv_cache_usage_perc"),
            "open_sockets_after": len(self.open_sockets),
            "rss_after_warmup_mib": round(self.rss_after_warmup_kib / 1024, 1),
            "rss_end_mib": round(self.rss_end_kib / 1024, 1),
            "rss_growth_pct": round(100 * self.rss_growth, 2),
        }


def _request(rng: random.Random, fate: str) -> tuple[str, dict[str, object]]:
    stream = rng.random() < 0.7
    chat = rng.random() < 0.4
    body: dict[str, object] = {
        "max_tokens": rng.randint(1, 8),
        "temperature": rng.choice([0, 0.8]),
        "ignore_eos": rng.random() < 0.5,
        "stream": stream,
    }
    if rng.random() < 0.2:
        body["n"] = 2
    if fate == "bad input":
        body[rng.choice(["temperature", "n", "max_tokens"])] = -1
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {rng.randint(0, 999)}"}]
        return "/v1/chat/completions", body
    body["prompt"] = rng.choice(["def add(a, b):", "import os\n", "class Stack:", "for i in"])
    return "/v1/completions", body


async def _one(port: int, rng: random.Random, fate: str, result: SoakResult) -> None:
    path, payload = _request(rng, fate)
    body = json.dumps(payload).encode()
    stop_after = rng.randint(1, 4)  # events read before a mid-stream disconnect
    cancel_after = rng.uniform(0.0, 0.5)
    reader, writer = await asyncio.open_connection(HOST, port)
    status = "none"
    try:
        head = request_head("POST", path, len(body))
        if fate == "drop mid-body":
            writer.write(head + body[: len(body) // 2])
            await writer.drain()
            return
        writer.write(head + body)
        await writer.drain()

        async def read_all() -> None:
            nonlocal status
            code, headers = await read_head(reader)
            status = str(code)
            buffer, events = bytearray(), []
            async for piece in iter_body(reader, headers):
                buffer += piece
                events += sse_payloads(buffer)
                if fate == "disconnect mid-stream" and len(events) >= stop_after:
                    return
            if (
                fate == "complete"
                and code == 200
                and payload["stream"]
                and events[-1:] != [b"[DONE]"]
            ):
                result.incomplete.append(f"{path} {payload}")

        if fate == "cancel at a random moment":
            try:
                await asyncio.wait_for(read_all(), cancel_after)
            except TimeoutError:
                pass
        else:
            await asyncio.wait_for(read_all(), 120)
    except (ConnectionError, asyncio.IncompleteReadError):
        if fate == "complete":
            result.incomplete.append(f"{path} {payload} (connection lost)")
    finally:
        result.statuses[status] += 1
        writer.close()
        try:
            await writer.wait_closed()
        except ConnectionError:
            pass


async def soak(
    port: int, server_pid: int, num_requests: int, concurrency: int, seed: int
) -> SoakResult:
    """Runs the soak and waits for the server to go idle; the caller asserts."""
    rng = random.Random(seed)
    names, weights = list(FATES), list(FATES.values())
    plan = [
        (random.Random(rng.random()), rng.choices(names, weights)[0]) for _ in range(num_requests)
    ]
    result = SoakResult(requests=num_requests)
    limit = asyncio.Semaphore(concurrency)
    done = 0
    warmup = min(WARMUP_REQUESTS, num_requests // 2)  # a short run (--quick) warms less
    warm = asyncio.Event()

    async def run(request_rng: random.Random, fate: str) -> None:
        nonlocal done
        async with limit:
            result.fates[fate] += 1
            await _one(port, request_rng, fate, result)
        done += 1
        if done == warmup:
            warm.set()

    start = time.perf_counter()
    tasks = [asyncio.ensure_future(run(r, fate)) for r, fate in plan]
    await warm.wait()
    result.rss_after_warmup_kib = resident_kib(server_pid)
    await asyncio.gather(*tasks)
    result.seconds = time.perf_counter() - start
    result.final_metrics = await wait_idle(port, within=60)
    deadline = time.monotonic() + 30
    while open_server_sockets(port) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    result.open_sockets = open_server_sockets(port)
    result.rss_end_kib = resident_kib(server_pid)
    return result
