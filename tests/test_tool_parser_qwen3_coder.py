"""The `qwen3_coder` tool parser without a server: whole outputs, and every output
streamed at every split adding up to the whole reading."""

from __future__ import annotations

import json

import pytest
from tool_cases import CALL_ID, calls

from asyncllm.server.tool_parsers import get_tool_parser
from asyncllm.server.tool_parsers.base import collect
from asyncllm.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

WEATHER = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 🌍\n</parameter>\n"
    "<parameter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>"
)
NESTED = '{"a": [1, {"b": "</function>"}], "q": "say \\"hi\\""}'
TIME = (
    f"<tool_call>\n<function=get_time>\n<parameter=zone>\n-2\n</parameter>\n"
    f"<parameter=opts>\n{NESTED}\n</parameter>\n<parameter=note>\nline one\nline two\n"
    "</parameter>\n</function>\n</tool_call>"
)
WEATHER_ARGS = '{"city": "Zürich 🌍", "unit": "celsius"}'
TIME_ARGS = (
    '{"zone": -2, "opts": ' + json.dumps(json.loads(NESTED)) + ', "note": "line one\\nline two"}'
)
# (text, content, [(name, arguments)])
CASES = [
    (WEATHER, None, [("get_weather", WEATHER_ARGS)]),
    (
        f"Let me check.\n{WEATHER}\n{TIME}",
        "Let me check.\n",
        [
            ("get_weather", WEATHER_ARGS),
            ("get_time", TIME_ARGS),
        ],
    ),
    ("<tool_call>\n<function=ping>\n</function>\n</tool_call> done", "done", [("ping", "{}")]),
    # not calls: content as written
    ("The weather is fine.", "The weather is fine.", []),
    ("<tool_call>\nnot a function\n</tool_call>", "<tool_call>\nnot a function\n</tool_call>", []),
    ("text <tool_ca", "text <tool_ca", []),
]


def fed(text: str, cuts: list[int], parallel: bool = True) -> list:
    parser = Qwen3CoderToolParser(parallel)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_whole_and_streamed_at_every_split(case):
    text, content, want = case
    whole = Qwen3CoderToolParser().extract(text)
    assert (whole.content, calls(whole)) == (content, want)
    assert all(CALL_ID.fullmatch(c.id) for c in whole.tool_calls)
    for c in whole.tool_calls:
        json.loads(c.arguments)  # valid JSON
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    for cuts in splits:
        deltas = fed(text, cuts)
        got = collect(deltas)
        assert (got.content, calls(got)) == (content, want), cuts
        for index in range(len(got.tool_calls)):
            pieces = [p for d in deltas for p in d.tool_calls if p.index == index]
            assert pieces[0].id and pieces[0].name and pieces[0].arguments == ""
            assert all(p.id is None for p in pieces[1:])


def test_parameters_stream_as_they_close():
    deltas = fed(TIME, list(range(1, len(TIME))))
    pieces = [p.arguments for d in deltas for p in d.tool_calls if p.id is None]
    assert pieces == [
        '{"zone": -2',
        ', "opts": ' + json.dumps(json.loads(NESTED)),
        ', "note": "line one\\nline two"',
        "}",
    ]


def test_a_call_cut_by_max_tokens_keeps_its_pieces_and_never_raises():
    text = WEATHER[: WEATHER.index("<parameter=unit>") + 20]
    for cut in range(len(text) + 1):
        got = collect(fed(text, [cut]))
        assert calls(got) == [("get_weather", '{"city": "Zürich 🌍"')]


def test_only_the_first_call_without_parallel_tool_calls():
    text = f"{WEATHER}\n{TIME}"
    for cuts in ([], list(range(1, len(text)))):
        got = collect(fed(text, cuts, parallel=False))
        assert calls(got) == [("get_weather", WEATHER_ARGS)] and got.content is None
    assert get_tool_parser("qwen3_coder") is Qwen3CoderToolParser
