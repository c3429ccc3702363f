"""Tool calling end to end: `/v1/chat/completions` with tools as a real process
driven by the official `openai` client, and `LLM.chat`.

The test models have random weights, so they write no tool calls on their own:
"auto" is checked end to end by comparing the server's reply with what the
parser makes of the same seed's raw text (the parser itself on written outputs
is in test_tool_parsers.py); "required" and named outputs are constrained by the
engine and validated against their schemas."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tool_cases import CALL_ID, TIME, TOOLS, calls, reassemble, strip_ids

from asyncllm import LLM, SamplingParams
from asyncllm.chat_template import ChatTemplate, prepare_messages, resolve_template_source
from asyncllm.errors import InvalidRequestError
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.server.tool_parsers.hermes import HermesToolParser
from server_process import post, serving
from tiny_models import make_tiny_qwen

openai = pytest.importorskip("openai")


# -- the real server ------------------------------------------------------------------

MODEL = "tiny-qwen"
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Paris and the time in zone 1?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"zone": 1}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny random-weight Qwen2 with the qwen2.5 tokenizer and its chat template."""
    return make_tiny_qwen(tmp_path_factory.mktemp("qwen2-tools"))


@pytest.fixture(scope="module")
def server(qwen_dir, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("tools-server")
    with serving(log_dir, qwen_dir, MODEL, "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client: Any, **kw: Any) -> Any:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": 24,
        "temperature": 1.0,
        "seed": 7,
        **kw,
    }
    return client.chat.completions.create(**body)


def streamed(client: Any, **kw: Any) -> dict[int, dict[str, Any]]:
    stream = chat(client, stream=True, **kw)
    return reassemble([chunk.model_dump() for chunk in stream])


def test_auto_reply_is_the_parser_reading_of_the_same_output(client):
    """Same seed, same prompt (the tools are rendered with "none" too): the "auto"
    reply is what the hermes parser makes of the raw text, streamed or not."""
    raw = chat(client, tools=TOOLS, tool_choice="none", n=2)
    auto = chat(client, tools=TOOLS, n=2)
    live = streamed(client, tools=TOOLS, n=2)
    for r, a in zip(raw.choices, auto.choices, strict=True):
        assert r.message.tool_calls in (None, [])
        want = HermesToolParser().extract(r.message.content)
        assert a.message.content == want.content
        got_calls = [(c.function.name, c.function.arguments) for c in a.message.tool_calls or []]
        assert got_calls == calls(want)
        assert a.finish_reason == (
            "tool_calls" if want.tool_calls and r.finish_reason == "stop" else r.finish_reason
        )
        s = live[a.index]
        assert s["content"] == a.message.content or (s["content"] is None and not a.message.content)
        assert strip_ids(s["tool_calls"]) == strip_ids(
            [c.model_dump() for c in a.message.tool_calls or []]
        )
        assert s["finish"] == a.finish_reason


def test_tools_reach_the_prompt(client, server, qwen_dir):
    plain = chat(client, max_tokens=1)
    with_tools = chat(client, tools=TOOLS, max_tokens=1)
    tok = Tokenizer(qwen_dir)
    template = ChatTemplate(
        resolve_template_source(None, tok.config, (qwen_dir,)), tok.bos_token, tok.eos_token
    )
    text = template.render(MESSAGES, True, {"tools": TOOLS})
    assert with_tools.usage.prompt_tokens == len(tok.encode(text, add_special_tokens=False))
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50


def test_tokenize_renders_tools_as_chat_does(client, server):
    """/tokenize with `tools` counts the prompt the chat endpoint runs."""
    with_tools = chat(client, tools=TOOLS, max_tokens=1)
    status, body = post(server.url + "/tokenize", {"messages": MESSAGES, "tools": TOOLS})
    assert status == 200, body
    assert body["count"] == with_tools.usage.prompt_tokens
    status, plain = post(server.url + "/tokenize", {"messages": MESSAGES})
    assert status == 200, plain
    assert body["count"] > plain["count"] + 50
    status, bad = post(server.url + "/tokenize", {"messages": MESSAGES, "tools": TOOLS + TOOLS[:1]})
    assert status == 400 and "two functions named" in json.dumps(bad), bad


def test_history_with_tool_calls_and_results_renders(server, qwen_dir):
    status, body = post(server.url + "/tokenize", {"messages": HISTORY})
    assert status == 200, body
    tok = Tokenizer(qwen_dir)
    text = tok.decode(body["tokens"], skip_special_tokens=False)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>\n<tool_response>\n14:05" in text


def test_named_function_reply_streamed_and_not(client):
    """The reply is a call of the named function; streamed it reassembles to the
    same call (whatever the constrained engine wrote)."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, tools=TOOLS, tool_choice=choice)
    (call,) = whole.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and CALL_ID.fullmatch(call.id)
    assert whole.choices[0].message.content is None
    live = streamed(client, tools=TOOLS, tool_choice=choice)[0]
    assert strip_ids(live["tool_calls"]) == strip_ids([call.model_dump()])
    assert live["finish"] == whole.choices[0].finish_reason


def test_required_reply_streamed_and_not(client):
    whole = chat(client, tools=TOOLS, tool_choice="required")
    live = streamed(client, tools=TOOLS, tool_choice="required")[0]
    message = whole.choices[0].message
    assert strip_ids(live["tool_calls"]) == strip_ids(
        [c.model_dump() for c in message.tool_calls or []]
    )
    assert live["content"] == message.content and live["finish"] == whole.choices[0].finish_reason


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_function_arguments_validate(client, seed):
    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(client, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=64)
    assert whole.choices[0].finish_reason == "stop"
    (call,) = whole.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_calls_validate(client, seed, parallel):
    jsonschema = pytest.importorskip("jsonschema")
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    kw = {"tools": TOOLS, "tool_choice": "required", "seed": seed, "max_tokens": 128}
    kw["parallel_tool_calls"] = parallel
    whole = chat(client, **kw)
    assert whole.choices[0].finish_reason == "tool_calls"
    assert whole.choices[0].message.content is None
    assert whole.choices[0].message.tool_calls
    if not parallel:
        assert len(whole.choices[0].message.tool_calls) == 1
    for call in whole.choices[0].message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    live = streamed(client, **kw)[0]
    assert strip_ids(live["tool_calls"]) == strip_ids(
        [c.model_dump() for c in whole.choices[0].message.tool_calls]
    )


def test_bad_tool_requests_are_400s_naming_the_problem(client):
    cases = [
        (
            {
                "tools": TOOLS,
                "tool_choice": {"type": "function", "function": {"name": "launch_rocket"}},
            },
            "launch_rocket",
        ),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}
                        ],
                    }
                ]
            },
            "messages[0].tool_calls[0].function.arguments",
        ),
    ]
    for kw, needle in cases:
        with pytest.raises(openai.BadRequestError) as err:
            chat(client, **kw)
        assert needle in err.value.message, (kw, err.value.message)
    assert chat(client, max_tokens=2).choices[0].message.content is not None  # still serving


# -- LLM.chat -----------------------------------------------------------------------------


def test_llm_chat_with_and_without_tools(qwen_dir):
    tok = Tokenizer(qwen_dir)
    template = ChatTemplate(
        resolve_template_source(None, tok.config, (qwen_dir,)), tok.bos_token, tok.eos_token
    )
    params = SamplingParams(max_tokens=4, temperature=0)
    with LLM(str(qwen_dir), dtype="float32", multiprocess=False) as llm:
        (one,) = llm.chat(MESSAGES, params, use_tqdm=False)
        want = tok.encode(template.render(MESSAGES), add_special_tokens=False)
        assert one.prompt_token_ids == want and len(one.outputs[0].token_ids) == 4

        both = llm.chat([MESSAGES, HISTORY], params, use_tqdm=False, tools=TOOLS)
        for out, conv in zip(both, [MESSAGES, HISTORY], strict=True):
            text = template.render(prepare_messages(conv), True, {"tools": TOOLS})
            assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
            assert "get_time" in out.prompt
        # the same prompt through generate gives the same output (greedy)
        (again,) = llm.generate({"prompt_token_ids": want}, params, use_tqdm=False)
        assert again.outputs[0].token_ids == one.outputs[0].token_ids

        with pytest.raises(
            InvalidRequestError, match=r"conversation 1: messages\[0\].tool_call_id"
        ):
            llm.chat([MESSAGES, [{"role": "tool", "content": "x"}]], params, use_tqdm=False)
        with pytest.raises(InvalidRequestError, match=r"tools\[0\]"):
            llm.chat(MESSAGES, params, use_tqdm=False, tools=[{"name": "f"}])
        inline = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
        (custom,) = llm.chat(MESSAGES, params, use_tqdm=False, chat_template=inline)
        assert custom.prompt == "<user>What is the weather in Paris?"
