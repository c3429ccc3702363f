"""Tool calling without a server: the Hermes/Qwen parser (whole and streamed at
every split), the parsers of forced output, the schema "required" constrains to,
and the server's reply and chunks for tool calls."""

from __future__ import annotations

import json
from typing import Any

import pytest
from tool_cases import CALL_ID, TIME, TOOLS, WEATHER, calls, reassemble, strip_ids

from asyncllm import SamplingParams
from asyncllm.errors import ConfigError
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
    from asyncllm.cli.main import main

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
    from asyncllm.structured_output.params import StructuredOutputsParams

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
