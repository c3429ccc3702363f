"""Tool calling: the Hermes/Qwen parser (whole and streamed at every split), the
parsers of forced output, the schema "required" constrains to, the server's reply
and chunks for tool calls, `/v1/chat/completions` with tools as a real process
driven by the official `openai` client, and `LLM.chat`.

The test models have random weights, so they write no tool calls on their own:
"auto" is checked end to end by comparing the server's reply with what the parser
makes of the same seed's raw text, and the parser itself on written outputs.
Whether "required" and named outputs match their schemas needs the engine to
enforce `structured_outputs` (the structured branch); those tests skip until the
extension has it, and run once it does."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

import asyncllm._core
from asyncllm import LLM, SamplingParams
from asyncllm.chat_template import ChatTemplate, prepare_messages, resolve_template_source
from asyncllm.errors import ConfigError, InvalidRequestError
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.server.protocol import APIError, ChatCompletionRequest
from asyncllm.server.serving_tools import (
    ToolStream,
    constrain,
    plan_tools,
    required_schema,
    tool_message,
)
from asyncllm.server.sse import ChunkRenderer
from asyncllm.server.tool_parsers import get_tool_parser, tool_parser_names
from asyncllm.server.tool_parsers.base import MAX_CALL_CHARS, MAX_TOOL_CALLS, collect
from asyncllm.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from asyncllm.server.tool_parsers.hermes import HermesToolParser
from server_process import Server, post
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")

HAS_STRUCTURED = any(
    "grammar" in name.lower() or "structured" in name.lower() for name in dir(asyncllm._core)
)
needs_structured = pytest.mark.skipif(
    not HAS_STRUCTURED,
    reason="needs the structured branch (the engine enforcing structured_outputs)",
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            # closed, so that a random-weight model's constrained output ends
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def calls(found: Any) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in found.tool_calls]


# -- the hermes parser ------------------------------------------------------------

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = (
    'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    '</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{"zone": {"a": [1, "}"]} }}'
    "\n</tool_call>\n"
)
# (text, content, [(name, arguments)]) as the non-streamed reply has them
CASES = [
    (ONE, None, [("get_weather", '{"city": "Paris"}')]),
    (
        TWO,
        "Let me look.",
        [("get_weather", '{"city": "Zürich"}'), ("get_time", '{"zone": {"a": [1, "}"]} }')],
    ),
    ("no calls here, just <b>text</b> and <tool_ things  ", None, []),
    # keys in the other order: arguments re-serialised
    ('<tool_call>{"arguments": {"x": 1}, "name": "f"}</tool_call>', None, [("f", '{"x": 1}')]),
    # the output ends inside a complete block (EOS before the closing tag)
    (
        'Sure <tool_call>{"name": "f", "arguments": {"q": "</tool_call"}}',
        "Sure",
        [("f", '{"q": "</tool_call"}')],
    ),
    # malformed blocks stay content, markup included
    ('<tool_call>{"name": f, "arguments": {}}</tool_call> after', None, []),
    ('<tool_call>{"name": "f"}</tool_call>', None, []),
    ("<tool_call>[1, 2]</tool_call>", None, []),
    ('x <tool_call>{"name": "f", "arguments": {"a":', None, []),  # cut by max_tokens
    ('<tool_call>{"name": "f", "arguments": {bad}}</tool_call> after', None, []),
]
# Streamed, these two keep the call whose name was sent before the JSON broke.
BROKEN_LATE = {8, 9}


def content_of(case: tuple[str, str | None, list]) -> str | None:
    text, content, found = case
    return text if content is None and not found else content


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_hermes_whole_output(case):
    text, _, want = case
    found = HermesToolParser().extract(text)
    assert calls(found) == want
    assert found.content == content_of(case)
    assert all(CALL_ID.fullmatch(c.id) for c in found.tool_calls)
    assert len({c.id for c in found.tool_calls}) == len(found.tool_calls)


def _streamed(text: str, cuts: list[int], **kw: Any) -> list[Any]:
    """The deltas of `text` fed in pieces cut at `cuts`, the last with finish()."""
    parser = HermesToolParser(**kw)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


@pytest.mark.parametrize(
    "case", [c for i, c in enumerate(CASES) if i not in BROKEN_LATE], ids=lambda c: c[0][:20]
)
def test_hermes_streamed_at_every_split_reassembles_to_the_whole(case):
    text = case[0]
    whole = HermesToolParser().extract(text)
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    for cuts in splits:
        deltas = _streamed(text, cuts)
        got = collect(deltas)
        assert (got.content, calls(got)) == (whole.content, calls(whole)), cuts
        if whole.tool_calls:  # no markup reaches the content
            assert "<tool" not in "".join(d.content for d in deltas)
        for index in range(len(got.tool_calls)):
            pieces = [p for d in deltas for p in d.tool_calls if p.index == index]
            first, rest = pieces[0], pieces[1:]
            assert CALL_ID.fullmatch(first.id) and first.name and first.arguments == ""
            assert first.to_openai()["type"] == "function"
            assert all(p.id is None and p.name is None for p in rest)


def test_hermes_streams_arguments_in_pieces_as_they_come():
    text = TWO
    deltas = _streamed(text, list(range(1, len(text))))
    pieces = [p for d in deltas for p in d.tool_calls if p.index == 0 and p.id is None]
    assert len(pieces) > 5  # the arguments of the first call came in many pieces
    # the name came before the call's block closed
    closed_at = text.index("</tool_call>")
    sent = [i for i, d in enumerate(deltas) if any(p.index == 0 for p in d.tool_calls)]
    assert sent[0] < closed_at


def test_hermes_text_without_calls_is_kept_exactly():
    text = "  two spaces, a newline\n and <tool_call but no block \n\n"
    for cut in range(len(text) + 1):
        got = collect(_streamed(text, [cut]))
        assert got.content == text and not got.tool_calls


@pytest.mark.parametrize("case", [CASES[i] for i in sorted(BROKEN_LATE)], ids=["cut", "bad"])
def test_hermes_broken_after_the_name_was_streamed_does_not_crash(case):
    """Streaming cannot take back a name already sent: the call stays, and no
    markup leaks into the content. Cut where the name had not arrived, or with
    the whole block in one piece, the stream reads as the non-streamed reply."""
    text = case[0]
    header_end = text.index("{", text.index('"arguments"'))
    block_end = text.find("</tool_call>") + len("</tool_call>") if "</tool_call>" in text else 0
    for cut in range(len(text) + 1):
        got = collect(_streamed(text, [cut]))
        if cut <= header_end or (block_end and cut >= block_end):
            assert got.content == content_of(case) and not got.tool_calls
        else:
            assert [c.name for c in got.tool_calls] == ["f"]
            assert "<tool" not in (got.content or "")


def test_hermes_parallel_tool_calls_false_keeps_the_first_call():
    found = HermesToolParser(parallel_tool_calls=False).extract(TWO)
    assert [c.name for c in found.tool_calls] == ["get_weather"]
    for cut in range(0, len(TWO) + 1, 7):
        got = collect(_streamed(TWO, [cut], parallel_tool_calls=False))
        assert calls(got) == calls(found) and got.content == found.content


def test_hermes_bounds_calls_and_call_size():
    block = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    found = HermesToolParser().extract(block * (MAX_TOOL_CALLS + 3))
    assert len(found.tool_calls) == MAX_TOOL_CALLS
    assert found.content == block * 3  # the calls past the bound stay text
    huge = (
        '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * MAX_CALL_CHARS + '"}}</tool_call>'
    )
    assert HermesToolParser().extract(huge).tool_calls == []


def test_parsers_are_found_by_name():
    assert get_tool_parser("hermes") is HermesToolParser
    assert "hermes" in tool_parser_names()
    with pytest.raises(ConfigError, match="known parsers: hermes"):
        get_tool_parser("mistral-ish")


def test_serve_rejects_an_unknown_parser_before_starting(capsys):
    from asyncllm.server.cli import main

    with pytest.raises(SystemExit, match="known parsers: hermes"):
        main(["serve", "--tool-call-parser", "nope"])


# -- the parsers of forced output ------------------------------------------------


def test_required_parser_reads_the_array_whole_and_streamed():
    text = (
        '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, '
        '{"name": "get_time", "parameters": {"zone": 1}}]'
    )
    whole = RequiredToolParser().extract(text)
    assert calls(whole) == [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": 1}')]
    assert whole.content is None
    for cut in range(len(text) + 1):
        parser = RequiredToolParser()
        got = collect([parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()])
        assert calls(got) == calls(whole) and got.content is None
    for bad in ['[{"name": "get_weather", "param', "not json", '{"name": "x"}']:
        found = RequiredToolParser().extract(bad)
        assert found.tool_calls == [] and found.content == bad


def test_named_parser_makes_the_output_the_arguments():
    parser = NamedToolParser("get_weather")
    deltas = [parser.feed('{"city"'), parser.feed(': "Rome"}'), parser.finish()]
    got = collect(deltas)
    assert calls(got) == [("get_weather", '{"city": "Rome"}')] and got.content is None
    assert deltas[0].tool_calls[0].name == "get_weather" and deltas[0].tool_calls[0].arguments == ""


# -- the server's plan, schema and reply builders -----------------------------------


def request(**body: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **body}
    return ChatCompletionRequest.model_validate(body)


def test_required_schema_accepts_calls_and_rejects_others():
    jsonschema = pytest.importorskip("jsonschema")
    req = request(tools=TOOLS)
    schema = required_schema(req.tools, parallel=True)
    ok = [
        {"name": "get_weather", "parameters": {"city": "Oslo"}},
        {"name": "get_time", "parameters": {"zone": -3}},
    ]
    jsonschema.validate(ok, schema)
    for bad in (
        [],
        [{"name": "get_time", "parameters": {"zone": 99}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],  # city is required
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(ok, required_schema(req.tools, parallel=False))


def test_required_schema_moves_defs_to_the_root():
    jsonschema = pytest.importorskip("jsonschema")
    tool = {
        "type": "function",
        "function": {
            "name": "place",
            "parameters": {
                "type": "object",
                "properties": {"at": {"$ref": "#/$defs/point"}},
                "$defs": {"point": {"type": "array", "items": {"type": "number"}}},
            },
        },
    }
    schema = required_schema(request(tools=[tool]).tools, parallel=True)
    assert "point" in schema["$defs"]
    jsonschema.validate([{"name": "place", "parameters": {"at": [1, 2]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "place", "parameters": {"at": "here"}}], schema)


def test_plan_constrains_required_and_named_as_vllm():
    from asyncllm.structured_outputs import StructuredOutputsParams

    req = request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}})
    params = constrain(req, plan_tools(req, HermesToolParser), SamplingParams(n=2))
    assert params.n == 2
    assert params.structured_outputs == StructuredOutputsParams(json=TIME["function"]["parameters"])
    req = request(tools=TOOLS, tool_choice="required")
    params = constrain(req, plan_tools(req, HermesToolParser), SamplingParams())
    assert params.structured_outputs.json["type"] == "array"
    for choice in ("auto", "none", None):
        req = request(tools=TOOLS, tool_choice=choice)
        params = constrain(req, plan_tools(req, HermesToolParser), SamplingParams())
        assert params.structured_outputs is None


def test_plan_rejects_what_cannot_be_served():
    named = {"type": "function", "function": {"name": "launch_rocket"}}
    with pytest.raises(APIError, match="launch_rocket") as err:
        plan_tools(request(tools=TOOLS, tool_choice=named), HermesToolParser)
    assert err.value.status == 400 and err.value.param == "tool_choice"
    with pytest.raises(APIError, match="needs tools"):
        plan_tools(request(tool_choice="required"), HermesToolParser)
    with pytest.raises(APIError, match="two functions named"):
        plan_tools(request(tools=[WEATHER, WEATHER]), HermesToolParser)


def test_reply_and_chunks_for_auto_hold_the_parsed_calls():
    """The server's builders on an output that holds tool calls: the message, and
    the chunks a client reassembles to the same message."""
    plan = plan_tools(request(tools=TOOLS), HermesToolParser)
    message, reason = tool_message(plan, TWO, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "get_time"]
    assert tool_message(plan, TWO, "length")[1] == "length"
    assert tool_message(plan, "plain", "stop") == (
        {"role": "assistant", "content": "plain", "refusal": None, "tool_calls": []},
        "stop",
    )

    renderer = ChunkRenderer("chatcmpl-x", 0, "m", True, False)
    stream = ToolStream(plan, renderer, 1)
    pieces = [TWO[i : i + 3] for i in range(0, len(TWO), 3)]
    chunks = [
        stream.chunk(0, p, "stop" if i == len(pieces) - 1 else None, b"null")
        for i, p in enumerate(pieces)
    ]
    events = [json.loads(c[len(b"data: ") :]) for c in chunks if c is not None]
    got = reassemble(events)[0]
    assert got["content"] == message["content"]
    assert strip_ids(got["tool_calls"]) == strip_ids(message["tool_calls"])
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def reassemble(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Chat chunks added up per choice as a client does: content, tool calls by
    index (id, type and name from the first piece, arguments concatenated)."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            msg = out.setdefault(
                choice["index"], {"content": None, "tool_calls": {}, "finish": None}
            )
            delta = choice["delta"]
            if delta.get("content"):
                msg["content"] = (msg["content"] or "") + delta["content"]
            for piece in delta.get("tool_calls") or []:
                call = msg["tool_calls"].setdefault(piece["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if piece.get(key):
                        call[key] = piece[key]
                fn = piece.get("function") or {}
                if fn.get("name"):
                    call["function"]["name"] = fn["name"]
                call["function"]["arguments"] += fn.get("arguments") or ""
            if choice["finish_reason"] is not None:
                msg["finish"] = choice["finish_reason"]
    for msg in out.values():
        msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return out


def strip_ids(tool_calls: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    for call in tool_calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]


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
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2-tools"),
        arch="qwen2",
        tokenizer="qwen2.5",
        hidden_size=32,
        tie_word_embeddings=True,
    )


@pytest.fixture(scope="module")
def server(qwen_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("tools-server") / "server.log"
    s = Server(
        log,
        str(qwen_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--tool-call-parser",
        "hermes",
    )
    yield s
    assert s.stop() == 0, log.read_text()[-3000:]


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
    same call (whatever the engine wrote: constrained once structured lands)."""
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


@needs_structured
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_named_function_arguments_validate(client, seed):
    jsonschema = pytest.importorskip("jsonschema")
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = chat(client, tools=TOOLS, tool_choice=choice, seed=seed, max_tokens=64)
    assert whole.choices[0].finish_reason == "stop"
    (call,) = whole.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])


@needs_structured
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
