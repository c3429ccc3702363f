"""Every bad-input class against a real `asyncllm serve` (asyncllm-tiny) with small
limits: the exact status, OpenAI's error shape, `param` naming the field and the
message stating the limit; a healthy greedy stream running beside them all ends
with the text it gets alone; the server logs no traceback for any of it."""

from __future__ import annotations

import asyncio

import pytest
from abuse_cases import (
    LIMITS,
    SERVED_MODEL,
    Case,
    all_cases,
    healthy_stream,
    limit_flags,
    problems,
    send_case,
)
from abuse_http import post_json, request, wait_idle

from server_process import Server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

CASES = all_cases(LIMITS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("abuse-inputs") / "server.log"
    srv = Server(log, *limit_flags(LIMITS))
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


@pytest.mark.parametrize("case", CASES, ids=[c.name.replace(" ", "-") for c in CASES])
def test_bad_input_is_answered_with_its_error(server, case: Case):
    reply = asyncio.run(send_case(server.port, case))
    assert problems(case, reply) == []


def test_a_healthy_stream_beside_every_bad_input_is_unchanged(server):
    async def run() -> None:
        alone = await healthy_stream(server.port)
        assert alone.finish_reason == "length" and alone.text
        beside = asyncio.ensure_future(healthy_stream(server.port))
        failures: list[str] = []
        passes = 0
        while passes == 0 or not beside.done():  # at least one whole pass while it runs
            for case in CASES:
                reply = await send_case(server.port, case)
                failures += [f"{case.name}: {p}" for p in problems(case, reply)]
            passes += 1
        run = await beside
        assert run.text == alone.text
        assert run.finish_reason == "length"
        assert failures == []
        assert (await request(server.port, "GET", "/health")).status == 200
        idle = await wait_idle(server.port)
        assert idle["asyncllm:num_requests_running"] == 0
        assert idle["asyncllm:kv_cache_usage_perc"] == 0

    asyncio.run(run())


def test_the_openai_client_sees_typed_errors(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=SERVED_MODEL, prompt="x", n=LIMITS["max_n"] + 1)
    assert bad.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(
            model=SERVED_MODEL,
            messages=[{"role": "user", "content": "hi"}] * (LIMITS["max_chat_messages"] + 1),
        )
    assert bad.value.body["param"] == "messages"
    with pytest.raises(openai.APIStatusError) as too_long:
        client.completions.create(
            model=SERVED_MODEL, prompt=[5] * (LIMITS["max_prompt_tokens"] + 1), max_tokens=1
        )
    assert too_long.value.status_code == 413 and too_long.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(
            model=SERVED_MODEL, prompt="x", stream=True, extra_body={"stop_token_ids": [8192]}
        )
    assert bad.value.body["param"] == "stop_token_ids"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="no-such-model", messages=[{"role": "user", "content": "hi"}]
        )
    # and it keeps serving
    out = client.completions.create(model=SERVED_MODEL, prompt="x", max_tokens=2)
    assert out.usage.completion_tokens == 2


def test_empty_text_prompt_and_empty_message_are_served(server):
    """Not bad input: an empty text is the model's BOS token alone, and a chat
    message may be empty (the template still renders a prompt)."""

    async def run() -> None:
        reply = await post_json(server.port, "/v1/completions", {"prompt": "", "max_tokens": 2})
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["prompt_tokens"] == 1
        reply = await post_json(
            server.port,
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": ""}], "max_tokens": 2},
        )
        assert reply.status == 200, reply.body
        assert reply.json()["usage"]["completion_tokens"] == 2

    asyncio.run(run())


def test_no_request_left_a_traceback_in_the_log(server):
    """Runs last in this module: after all of the above, nothing was a 500 or an
    unhandled error (a bad request is the client's problem, not an ERROR)."""
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
    assert " 500 " not in log and "ERROR" not in log, log[-4000:]
