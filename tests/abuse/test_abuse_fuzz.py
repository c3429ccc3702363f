"""Property-based fuzz of request bodies for /v1/completions,
/v1/chat/completions, /v1/responses and /v1/messages against a real `asyncllm
serve` (asyncllm-tiny with a 32-token context and small limits, so that any
request it accepts is quick). Every field
gets either a plausible value or a JSON value of any shape and type; some bodies
are not objects or not JSON at all. Whatever comes: never a 5xx, never a hang
(each request has a deadline), an error body in the endpoint's API's shape for
every 4xx, a whole response for every 200 (a stream ends with its API's last
event — [DONE], response.completed / .incomplete, message_stop — and carries no
error event);
afterwards the server is healthy with nothing running and no KV block in use.

The examples are derandomized so CI is reproducible; set ABUSE_FUZZ_SEED to
explore other ones.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from abuse_cases import SERVED_MODEL, VOCAB, limit_flags
from abuse_http import Reply, request, wait_idle

from server_process import Server

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.timeout(240)

FUZZ_LIMITS = {
    "max_model_len": 32,
    "max_n": 2,
    "max_prompts_per_request": 3,
    "max_prompt_chars": 2000,
    "max_stop_strings": 4,
    "max_stop_string_chars": 32,
    "max_chat_messages": 6,
    "max_concurrent_requests": 8,
}
REQUEST_TIMEOUT_S = 60.0  # a request unanswered for this long hangs
EXAMPLES = 80  # per endpoint
_SEED = os.environ.get("ABUSE_FUZZ_SEED")

# -- strategies ---------------------------------------------------------------------------

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-3, max_value=70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=12,
)
# plausible values lean on the edges: where off-by-one and overflow bugs live
token_ids = st.integers(min_value=0, max_value=VOCAB - 1) | st.sampled_from(
    [-1, VOCAB, VOCAB + 1, 2**63, 2**64]
)
small_text = st.text(max_size=60)
counts = st.integers(min_value=-1, max_value=8) | st.sampled_from([33, 2**31])


def either(plausible: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a plausible value (valid or just out of range), sometimes anything."""
    return st.one_of(plausible, plausible, plausible, plausible, json_values)


def floats(low: float, high: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=low, max_value=high) | st.sampled_from([0.0, 1.0, 1e-9, -1e-9])


SAMPLING = {
    "model": st.sampled_from([SERVED_MODEL, SERVED_MODEL, "other-model", ""]),
    "max_tokens": counts | st.none() | st.just(2**63),
    "n": st.integers(min_value=-1, max_value=3),
    "temperature": floats(-0.5, 3.0),
    "top_p": floats(-0.5, 1.5),
    "top_k": st.integers(min_value=-2, max_value=VOCAB + 1),
    "min_p": floats(-0.5, 1.5),
    "seed": st.integers(min_value=0, max_value=2**64 - 1) | st.sampled_from([-1, 2**64 - 1, 2**64]),
    "stop": small_text | st.lists(st.text(max_size=40), max_size=6),
    "stop_token_ids": st.lists(token_ids, max_size=6),
    "presence_penalty": floats(-3, 3),
    "frequency_penalty": floats(-3, 3),
    "repetition_penalty": floats(-1, 3),
    "ignore_eos": st.booleans(),
    "min_tokens": counts,
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logit_bias": st.dictionaries(st.text(max_size=6), floats(-100, 100), max_size=3),
    "user": small_text,
}
COMPLETION = {
    "prompt": small_text
    | st.lists(token_ids, min_size=0, max_size=20)
    | st.lists(small_text, max_size=4)
    | st.lists(st.lists(token_ids, max_size=8), max_size=4),
    "logprobs": st.integers(min_value=-1, max_value=25),
    "echo": st.booleans(),
    "suffix": small_text,
    "best_of": st.integers(min_value=0, max_value=3),
}
content_parts = st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": small_text}),
    max_size=3,
)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool"]) | st.text(max_size=10)},
    optional={"content": small_text | st.none() | content_parts, "name": small_text},
)
CHAT = {
    "messages": st.lists(message, max_size=8),
    "max_completion_tokens": counts,
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(min_value=-1, max_value=25),
    "add_generation_prompt": st.booleans(),
    "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_scalars, max_size=3),
    "tools": st.lists(st.dictionaries(st.text(max_size=8), json_scalars, max_size=2), max_size=2),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "other"])}
    ),
}

# /v1/responses: input items of every kind, right and wrong
response_item = st.fixed_dictionaries(
    {
        "type": st.sampled_from(
            ["message", "function_call", "function_call_output", "reasoning", "x"]
        )
    },
    optional={
        "role": st.sampled_from(["user", "system", "developer", "assistant", "tool"]),
        "content": small_text | json_values,
        "call_id": small_text,
        "name": small_text,
        "arguments": small_text,
        "output": small_text | json_values,
    },
)
RESPONSES = {
    "model": SAMPLING["model"],
    "input": small_text | st.lists(response_item, max_size=5),
    "instructions": small_text,
    "max_output_tokens": counts,
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "text": st.fixed_dictionaries(
        {
            "format": st.fixed_dictionaries(
                {"type": st.sampled_from(["text", "json_object", "yaml"])}
            )
        }
    ),
    "tools": st.lists(
        st.fixed_dictionaries(
            {"type": st.sampled_from(["function", "web_search"]), "name": small_text},
            optional={"parameters": json_values},
        ),
        max_size=2,
    ),
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | json_values,
    "parallel_tool_calls": st.booleans(),
    "stream": st.booleans(),
    "store": st.booleans(),
    "previous_response_id": small_text,
    "metadata": st.dictionaries(st.text(max_size=70), st.text(max_size=600), max_size=20),
}
# /v1/messages: content blocks of every kind, in either role
block = st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "tool_use", "tool_result", "thinking", "image"])},
    optional={
        "text": small_text,
        "id": small_text,
        "name": small_text,
        "input": json_values,
        "tool_use_id": small_text,
        "content": small_text | json_values,
    },
)
MESSAGES = {
    "model": SAMPLING["model"],
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant", "system"])},
            optional={"content": small_text | st.lists(block, max_size=3) | json_values},
        ),
        max_size=6,
    ),
    "max_tokens": counts,
    "system": small_text | st.lists(block, max_size=2),
    "stop_sequences": st.lists(st.text(max_size=40), max_size=6),
    "temperature": SAMPLING["temperature"],
    "top_p": SAMPLING["top_p"],
    "top_k": SAMPLING["top_k"],
    "tools": st.lists(
        st.fixed_dictionaries({"name": small_text}, optional={"input_schema": json_values}),
        max_size=2,
    ),
    "tool_choice": st.fixed_dictionaries(
        {"type": st.sampled_from(["auto", "any", "tool", "none", "x"])},
        optional={"name": small_text, "disable_parallel_tool_use": st.booleans()},
    ),
    "stream": st.booleans(),
}
VALID_MESSAGES = st.lists(
    st.fixed_dictionaries({"role": st.just("user"), "content": small_text}), min_size=1, max_size=3
)


VALID = {
    "prompt": small_text | st.lists(st.integers(min_value=0, max_value=VOCAB - 1), min_size=1),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant"]), "content": small_text}
        ),
        min_size=1,
        max_size=4,
    ),
    "input": small_text,
}


def bodies(
    required: str,
    fields: dict[str, st.SearchStrategy[Any]],
    valid: st.SearchStrategy[Any] | None = None,
    also_valid: dict[str, st.SearchStrategy[Any]] | None = None,
) -> st.SearchStrategy[bytes]:
    """Request bodies: mostly an object with the `required` field and a few others
    (few, so that many bodies are valid and reach the engine), now and then an
    unknown key; sometimes any JSON value or any bytes."""
    names = sorted(set(fields) - {required})

    @st.composite
    def draw_body(draw: st.DrawFn) -> bytes:
        kind = draw(st.integers(min_value=0, max_value=19))
        if kind == 0:
            return draw(st.binary(max_size=200))
        if kind == 1:
            return json.dumps(draw(json_values)).encode()
        body: dict[str, Any] = {}
        if kind == 2:
            body.update(draw(st.dictionaries(st.text(max_size=8), json_values, max_size=2)))
        if kind >= 12:  # a valid prompt or conversation, so the other fields matter
            body[required] = draw(valid if valid is not None else VALID[required])
            for name, strategy in (also_valid or {}).items():  # other required fields
                body[name] = draw(strategy)
        elif kind != 3:
            body[required] = draw(either(fields[required]))
        for name in draw(st.lists(st.sampled_from(names), max_size=4, unique=True)):
            body[name] = draw(either(fields[name]))
        return json.dumps(body).encode()

    return draw_body()


# -- checks -------------------------------------------------------------------------------


def answered(reply: Reply, body: bytes) -> None:
    """An answer, whole, and not a 5xx."""
    event(f"status {reply.status}{' streamed' if reply.events else ''}")
    shown = body[:300]
    assert reply.status != 0, f"no answer: {reply.body!r} to {shown!r}"
    assert reply.status < 500, f"{reply.status} {reply.body[:300]!r} to {shown!r}"
    assert reply.complete, f"cut off mid-body: {reply.body[-300:]!r} to {shown!r}"


def check(reply: Reply, body: bytes) -> None:
    answered(reply, body)
    shown = body[:300]
    if reply.status >= 400:
        error = reply.error()
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and len(error["message"]) < 1000, error
        return
    assert reply.status == 200, reply
    if reply.events:
        assert reply.events[-1] == b"[DONE]", reply.events[-3:]
        for data in reply.events[:-1]:
            assert b'"error"' not in data[:20], f"{data[:300]!r} to {shown!r}"
            json.loads(data)
    else:
        assert reply.json()["choices"], reply.body[:300]


def post(port: int, path: str, body: bytes) -> Reply:
    async def go() -> Reply:
        try:
            return await request(port, "POST", path, body, timeout=REQUEST_TIMEOUT_S)
        except TimeoutError:
            return Reply(0, {}, b"timed out")

    return asyncio.run(go())


def fuzz_settings(func: Any) -> Any:
    func = settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=_SEED is None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )(func)
    return seed(int(_SEED))(func) if _SEED is not None else func


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("abuse-fuzz") / "server.log"
    srv = Server(log, *limit_flags(FUZZ_LIMITS))
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


@fuzz_settings
@given(body=bodies("prompt", {**SAMPLING, **COMPLETION}))
def test_fuzz_completions(server, body: bytes):
    check(post(server.port, "/v1/completions", body), body)


@fuzz_settings
@given(body=bodies("messages", {**SAMPLING, **CHAT}))
def test_fuzz_chat(server, body: bytes):
    check(post(server.port, "/v1/chat/completions", body), body)


def check_turn(reply: Reply, body: bytes, last: tuple[str, ...], whole: str) -> None:
    """/v1/responses and /v1/messages: a stream of typed events ending with one
    of `last`, no error event; a whole reply with `whole`."""
    answered(reply, body)
    if reply.status >= 400:
        return
    assert reply.status == 200, reply
    if reply.events:
        kinds = [json.loads(data)["type"] for data in reply.events]
        assert "error" not in kinds, reply.events[-3:]
        assert kinds[-1] in last, kinds[-3:]
    else:
        assert whole in reply.json(), reply.body[:300]


@fuzz_settings
@given(body=bodies("input", RESPONSES))
def test_fuzz_responses(server, body: bytes):
    reply = post(server.port, "/v1/responses", body)
    if reply.status >= 400:
        error = reply.error()
        assert set(error) == {"message", "type", "param", "code"}, error
    check_turn(reply, body, ("response.completed", "response.incomplete"), "output")


@fuzz_settings
@given(body=bodies("messages", MESSAGES, VALID_MESSAGES, {"max_tokens": st.integers(1, 8)}))
def test_fuzz_messages(server, body: bytes):
    reply = post(server.port, "/v1/messages", body)
    if reply.status >= 400:
        payload = reply.json()
        assert payload["type"] == "error" and set(payload["error"]) == {"type", "message"}
    check_turn(reply, body, ("message_stop",), "content")


def test_healthy_after_the_fuzz(server):
    async def run() -> None:
        assert (await request(server.port, "GET", "/health")).status == 200
        idle = await wait_idle(server.port)
        assert idle["asyncllm:num_requests_running"] == 0
        assert idle["asyncllm:num_requests_waiting"] == 0
        assert idle["asyncllm:kv_cache_usage_perc"] == 0

    asyncio.run(run())
    log = server.log.read_text()
    assert "Traceback" not in log, log[-4000:]
