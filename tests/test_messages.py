"""`POST /v1/messages` (Anthropic's Messages API) end to end: a real `asyncllm
serve` (tiny random-weight Qwen2 with the qwen2.5 chat template, an API key,
`--reasoning-parser qwen3`) driven by the official `anthropic` client.

Where a test needs a shape the random model would not write (reasoning, a stop
sequence, a tool call), the engine is constrained to it with structured output
(over the whole output, reasoning included: `enable_in_reasoning`) or
tool_choice; the server's reading of the output is what is checked."""

from __future__ import annotations

import re
from typing import Any

import pytest
from tool_cases import TOOLS

from server_process import post, serving
from tiny_models import make_tiny_qwen

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "tiny-qwen"
KEY = "sk-messages-test"
THINK = r"<think>[a-z ]{1,12}</think>[a-z ]{1,12}"
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"].get("description", ""),
        "input_schema": t["function"]["parameters"],
    }
    for t in TOOLS
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_qwen(tmp_path_factory.mktemp("qwen2-messages"))
    with serving(
        tmp_path_factory.mktemp("messages-server"),
        model,
        MODEL,
        "--api-key",
        KEY,
        "--reasoning-parser",
        "qwen3",
        # the shapes are forced on the whole output, the reasoning included
        "--structured-outputs-config",
        '{"enable_in_reasoning": true}',
    ) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def greedy(extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """`extra_body` with temperature 0 (this anthropic SDK no longer takes
    temperature, top_p or top_k as arguments; the API and this server do)."""
    return {"temperature": 0.0, **(extra or {})}


def create(client: Any, **kw: Any) -> Any:
    body = {"model": MODEL, "max_tokens": 16, "messages": USER}
    kw["extra_body"] = greedy(kw.get("extra_body"))
    return client.messages.create(**{**body, **kw})


def test_text_reply_matches_chat_and_counts_tokens(client, server):
    m = create(client, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    (block,) = m.content
    assert block.type == "text"
    assert m.stop_reason in ("end_turn", "max_tokens")
    chat = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    same = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, *USER],
        max_tokens=16,
        temperature=0.0,
    )
    assert block.text == same.choices[0].message.content
    assert m.usage.input_tokens == same.usage.prompt_tokens
    assert m.usage.output_tokens == same.usage.completion_tokens
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER)
    assert counted.input_tokens == m.usage.input_tokens


def test_max_tokens_and_stop_sequences(client):
    cut = create(client, max_tokens=2, extra_body={"structured_outputs": {"regex": "[a-z]{9}"}})
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    regex = {"structured_outputs": {"regex": "[a-z]{2,4}X[a-z]{3}"}}
    stopped = create(client, stop_sequences=["X"], extra_body=regex)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "X"
    assert re.fullmatch("[a-z]{2,4}", stopped.content[0].text)


def test_stream_adds_up_to_the_message(client):
    whole = create(client, max_tokens=12)
    with client.messages.stream(
        model=MODEL, max_tokens=12, messages=USER, extra_body=greedy()
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_thinking_blocks_streamed_and_not(client):
    kw = {"max_tokens": 40, "extra_body": {"structured_outputs": {"regex": THINK}}}
    m = create(client, **kw)
    thinking, text = m.content
    assert thinking.type == "thinking" and text.type == "text"
    assert re.fullmatch(r"[a-z ]{1,12}", thinking.thinking)
    assert re.fullmatch(r"[a-z ]{1,12}", text.text)
    events = list(create(client, stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == thinking.thinking
    assert "".join(d.text for d in deltas if d.type == "text_delta") == text.text


def test_tool_use_round_trip_with_tool_result(client):
    m = create(
        client,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
        max_tokens=64,
    )
    assert m.stop_reason == "tool_use"
    (call,) = m.content
    assert call.type == "tool_use" and call.name == "get_weather" and "city" in call.input
    with client.messages.stream(
        model=MODEL,
        max_tokens=64,
        messages=USER,
        extra_body=greedy(),
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    assert final.content[0].input == call.input and final.stop_reason == "tool_use"
    follow = create(
        client,
        tools=ANTHROPIC_TOOLS,
        messages=[
            *USER,
            {"role": "assistant", "content": [call.model_dump()]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": call.id, "content": "18 C, sunny"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert follow.usage.input_tokens > m.usage.input_tokens
    assert follow.content


def test_tool_choice_any_calls_a_tool(client):
    m = create(
        client,
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=96,
    )
    assert m.stop_reason == "tool_use"
    assert [b.type for b in m.content] == ["tool_use"]


def test_errors_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, messages=[{"role": "user", "content": [{"type": "image"}]}])
    assert "messages.0.content.0" in err.value.message
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, stop_sequences=["x"] * 17)
    assert "stop_sequences" in err.value.message and "--max-stop-strings" in err.value.message
    with pytest.raises(anthropic.BadRequestError) as err:
        create(client, max_tokens=5000)  # the context is 1024
    assert "max_tokens" in err.value.message
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        create(bad)
    assert err.value.body["error"]["type"] == "authentication_error"
    status, body = post(
        server.url + "/v1/messages",
        {"model": MODEL, "messages": USER},
        {"Authorization": f"Bearer {KEY}"},
    )
    assert status == 400 and body["type"] == "error" and "max_tokens" in body["error"]["message"]


def test_thinking_reaches_the_template_as_enable_thinking():
    from asyncllm.server.protocol_messages import MessagesRequest, template_kwargs

    def kwargs(**kw: Any) -> Any:
        return template_kwargs(MessagesRequest(max_tokens=1, messages=USER, **kw))

    assert kwargs() is None
    assert kwargs(thinking={"type": "enabled", "budget_tokens": 1024}) == {"enable_thinking": True}
    assert kwargs(thinking={"type": "disabled"}) == {"enable_thinking": False}
    explicit = {"enable_thinking": True, "x": 1}
    assert kwargs(thinking={"type": "disabled"}, chat_template_kwargs=explicit) == explicit
