"""`POST /v1/responses` end to end: a real `asyncllm serve` (tiny random-weight
Qwen2 with the qwen2.5 chat template, `--reasoning-parser qwen3`,
`--enable-store`) driven by the official `openai` client's `responses.create`
and `responses.stream`.

The model has random weights, so where a test needs a shape (reasoning, a
tool call, JSON) the engine is constrained to it with structured output (over
the whole output, reasoning included: `enable_in_reasoning`); the server's
reading of the output is what is checked."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from tool_cases import TOOLS

from server_process import post, serving
from tiny_models import make_tiny_qwen

openai = pytest.importorskip("openai")

MODEL = "tiny-qwen"
THINK = r"<think>[a-z ]{1,12}</think>[a-z ]{1,12}"
FN_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_qwen(tmp_path_factory.mktemp("qwen2-responses"))
    with serving(
        tmp_path_factory.mktemp("responses-server"),
        model,
        MODEL,
        "--reasoning-parser",
        "qwen3",
        # the shapes are forced on the whole output, the reasoning included
        "--structured-outputs-config",
        '{"enable_in_reasoning": true}',
        "--enable-store",
        "--max-stored-responses",
        "4",
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="key-a", max_retries=0)


def create(client: Any, **kw: Any) -> Any:
    body = {"model": MODEL, "input": "Say hi", "max_output_tokens": 16, "temperature": 0.0}
    return client.responses.create(**{**body, **kw})


def test_plain_text_response_and_usage(client):
    r = create(client, instructions="Be brief.")
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.status in ("completed", "incomplete")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant"
    assert r.output_text == msg.content[0].text
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    # the same prompt as chat, greedy: the same text
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Say hi"},
        ],
        max_tokens=16,
        temperature=0.0,
    )
    assert chat.choices[0].message.content == r.output_text
    assert chat.usage.prompt_tokens == r.usage.input_tokens


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(
        client, max_output_tokens=2, extra_body={"structured_outputs": {"regex": "[a-z]{9}"}}
    )
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


def test_stream_events_add_up_to_the_response(client):
    kinds = []
    text = ""
    short = {"structured_outputs": {"regex": "[a-z ]{1,8}"}}  # ends within max_output_tokens
    kw = {"model": MODEL, "input": "Say hi", "max_output_tokens": 16, "extra_body": short}
    with client.responses.stream(**kw) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
        final = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert kinds[-1] == "response.completed" and final.status == "completed"
    assert final.output_text == text and text


def test_reasoning_items_streamed_and_not(client):
    """qwen3's parser puts `<think>…</think>` in a reasoning item, the rest in the
    message; streamed, reasoning_text deltas add up to the same."""
    kw = {"max_output_tokens": 40, "extra_body": {"structured_outputs": {"regex": THINK}}}
    r = create(client, **kw)
    reasoning, msg = r.output
    assert reasoning.type == "reasoning" and msg.type == "message"
    thought = reasoning.content[0].text
    assert re.fullmatch(r"[a-z ]{1,12}", thought)
    assert "<think>" not in r.output_text and re.fullmatch(r"[a-z ]{1,12}", r.output_text)
    events = list(create(client, stream=True, **kw))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (deltas, text) == (thought, r.output_text)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_text_format(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    fmt = {"format": {"type": "json_schema", "name": "digit", "schema": schema, "strict": True}}
    r = create(client, text=fmt, max_output_tokens=40)
    assert 0 <= json.loads(r.output_text)["n"] <= 9


def test_function_call_round_trip(client):
    """A named tool_choice makes the model call it; the call streamed adds up to
    the whole one; its output sent back as a function_call_output runs on."""
    choice = {"type": "function", "name": "get_weather"}
    r = create(client, tools=FN_TOOLS, tool_choice=choice, max_output_tokens=64)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert "city" in json.loads(call.arguments)
    events = list(
        create(client, tools=FN_TOOLS, tool_choice=choice, max_output_tokens=64, stream=True)
    )
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert args == done.arguments == call.arguments
    follow = create(
        client,
        tools=FN_TOOLS,
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"},
        ],
    )
    assert follow.output and follow.usage.input_tokens > r.usage.input_tokens


def test_required_tool_choice_calls_a_tool(client):
    r = create(
        client,
        tools=FN_TOOLS,
        tool_choice="required",
        max_output_tokens=96,
        parallel_tool_calls=False,
    )
    assert [o.type for o in r.output] == ["function_call"]
    assert r.output[0].name in ("get_weather", "get_time")


def test_store_previous_response_get_delete_scoped_per_key(client, server):
    first = create(client, input="My name is Ada.", store=True)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    second = create(client, input="What is my name?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    other = openai.OpenAI(base_url=server.url + "/v1", api_key="key-b", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        create(other, previous_response_id=first.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    events = list(create(client, input="Streamed and stored", stream=True))
    streamed_id = events[-1].response.id
    assert client.responses.retrieve(streamed_id).output_text == events[-1].response.output_text
    unstored = create(client, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_store_is_bounded_by_count(client):
    ids = [create(client, max_output_tokens=1).id for _ in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])  # --max-stored-responses 4: the oldest went
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


def test_bad_requests_name_the_field(client, server):
    cases = [
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": FN_TOOLS}, "nope"),
        ({"max_output_tokens": 10**6}, "max_output_tokens=1000000 is too large"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata has 17 keys"),
    ]
    for kw, needle in cases:
        with pytest.raises(openai.BadRequestError) as err:
            create(client, **kw)
        assert needle in err.value.message, (kw, err.value.message)
    status, body = post(
        server.url + "/v1/responses",
        {"model": MODEL, "input": [{"role": "user", "content": "x"}] * 1025},
        {"Authorization": "Bearer key-a"},
    )
    assert status == 400 and "--max-response-input-items" in body["error"]["message"]


def test_store_off_refuses_previous_response_id(tmp_path):
    """Checked on the serving object with the store off (no second server)."""
    from asyncllm.server.protocol_responses import ResponsesRequest
    from asyncllm.server.serving_responses import ResponsesServing

    serving = ResponsesServing.__new__(ResponsesServing)
    serving.store = None
    req = ResponsesRequest(input="x", previous_response_id="resp_1")
    with pytest.raises(Exception, match="--enable-store"):
        serving._history(req, "scope")


# -- chat on the same server: reasoning_content, and tool calls after reasoning --------

THINK_THEN_CALL = (
    r'<think>[a-z ]{1,12}</think>\n<tool_call>\n\{"name": "get_time", "arguments": '
    r'\{"zone": [1-9]\}\}\n</tool_call>'
)


def test_chat_reasoning_then_tool_call_streamed_and_not(client):
    """With the qwen3 parser and tools "auto", `<think>` goes to
    reasoning_content and the call after it to tool_calls; streamed through the
    real tokenizer's splits, the deltas add up to the same."""
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Time in zone 3?"}],
        "max_tokens": 64,
        "temperature": 0.0,
        "tools": TOOLS,
        "extra_body": {"structured_outputs": {"regex": THINK_THEN_CALL}},
    }
    whole = client.chat.completions.create(**kw)
    msg = whole.choices[0].message
    assert re.fullmatch(r"[a-z ]{1,12}", msg.model_extra["reasoning_content"])
    (call,) = msg.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] >= 1
    assert msg.content is None and whole.choices[0].finish_reason == "tool_calls"
    reasoning, args, content, finish = "", "", "", None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            delta = choice.delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            content += delta.content or ""
            for piece in delta.tool_calls or []:
                args += piece.function.arguments or ""
            finish = choice.finish_reason or finish
    assert reasoning == msg.model_extra["reasoning_content"]
    assert (args, content, finish) == (call.function.arguments, "", "tool_calls")
    r = create(
        client,
        tools=FN_TOOLS,
        input="Time in zone 3?",
        max_output_tokens=64,
        extra_body={"structured_outputs": {"regex": THINK_THEN_CALL}},
    )
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    assert r.output[1].arguments == call.function.arguments


@pytest.mark.parametrize("endpoint", ["responses", "messages"])
def test_bench_serving_speaks_the_endpoint(server, endpoint, capsys):
    from asyncllm.cli.main import main

    argv = ["bench", "serving", "--base-url", server.url, "--endpoint", endpoint]
    argv += ["--num-prompts", "4", "--output-len", "4", "--max-concurrency", "2", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["completed"] == 4 and result["failed"] == 0, result["first_error"]
    assert result["total_output_tokens"] == 16
    assert result["ttft_ms"]["median"] > 0 and result["itl_ms"]["p99"] > 0


def test_chat_reasoning_without_tools_n2(client):
    """No tools: reasoning_content and content per choice, whole and streamed."""
    kw = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Think, then answer."}],
        "max_tokens": 40,
        "n": 2,
        "seed": 3,
        "temperature": 1.0,
        "extra_body": {"structured_outputs": {"regex": THINK}},
    }
    whole = client.chat.completions.create(**kw)
    want = {
        c.index: (c.message.model_extra["reasoning_content"], c.message.content)
        for c in whole.choices
    }
    assert all(re.fullmatch(r"[a-z ]{1,12}", r) and "<" not in c for r, c in want.values())
    got: dict[int, list[str]] = {0: ["", ""], 1: ["", ""]}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            got[choice.index][0] += extra.get("reasoning_content") or ""
            got[choice.index][1] += choice.delta.content or ""
    assert {i: tuple(v) for i, v in got.items()} == want
