"""A soak of a real `asyncllm serve` (asyncllm-tiny): 2,000 short requests at
concurrency 64, a seeded mix of completed streams and non-streamed requests,
disconnects mid-stream, cancellations at a random moment, bodies dropped halfway
and bad input. Afterwards nothing runs or waits, every KV block is free, the
server holds no connection open, every admission slot is free again, its resident
memory is within 5 % of its level after the first 200 requests, and its log has
no traceback."""

from __future__ import annotations

import asyncio
import json

import pytest
from abuse_http import post_json
from abuse_soak import soak

from server_process import Server

pytestmark = pytest.mark.timeout(420)

NUM_REQUESTS = 2000
CONCURRENCY = 64
SEED = 20261201
MAX_RSS_GROWTH = 0.05


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("abuse-soak") / "server.log"
    # admission in sequences: room for every client's request with n=2
    srv = Server(log, "--max-concurrent-requests", str(2 * CONCURRENCY))
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


def test_soak_leaves_nothing_behind(server):
    result = asyncio.run(soak(server.port, server.proc.pid, NUM_REQUESTS, CONCURRENCY, SEED))
    summary = json.dumps(result.summary())
    print(summary)
    assert sum(result.fates.values()) == NUM_REQUESTS
    assert all(result.fates[f] > 0 for f in result.fates), summary
    assert result.incomplete == [], result.incomplete[:5]
    # every answer was a success or the bad input's 400; "none": the client left first
    assert set(result.statuses) <= {"200", "400", "none"}, summary
    assert result.statuses["400"] == result.fates["bad input"], summary
    m = result.final_metrics
    assert m["asyncllm:num_requests_running"] == 0, summary
    assert m["asyncllm:num_requests_waiting"] == 0, summary
    assert m["asyncllm:kv_cache_usage_perc"] == 0, summary
    assert result.open_sockets == [], result.open_sockets
    assert result.rss_growth <= MAX_RSS_GROWTH, summary

    async def all_slots_free() -> list[int]:
        body = {"prompt": "x", "max_tokens": 1, "n": 2}
        replies = await asyncio.gather(
            *(post_json(server.port, "/v1/completions", body) for _ in range(CONCURRENCY))
        )
        return [r.status for r in replies]

    assert asyncio.run(all_slots_free()) == [200] * CONCURRENCY
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
