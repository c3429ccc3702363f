"""The `pythonic` tool parser without a server: whole outputs, and every output
streamed at every split adding up to the whole reading."""

from __future__ import annotations

import json

import pytest
from tool_cases import CALL_ID, calls

from asyncllm.server.tool_parsers import get_tool_parser
from asyncllm.server.tool_parsers.base import collect
from asyncllm.server.tool_parsers.pythonic import PythonicToolParser

# (text, content, [(name, arguments)])
CASES = [
    ('[get_weather(city="Paris")]', None, [("get_weather", '{"city": "Paris"}')]),
    (
        "<|python_start|>[f(q='say \\'hi\\', ) (', n={'a': [1, (2, 3)], 'b': None}, ok=True),"
        ' g(), h(u="Zürich 🌍", x=-1.5)]<|python_end|>',
        None,
        [
            (
                "f",
                json.dumps({"q": "say 'hi', ) (", "n": {"a": [1, [2, 3]], "b": None}, "ok": True}),
            ),
            ("g", "{}"),
            ("h", json.dumps({"u": "Zürich 🌍", "x": -1.5}, ensure_ascii=False)),
        ],
    ),
    ("The weather is fine.", "The weather is fine.", []),
    ("[1, 2, 3]", "[1, 2, 3]", []),
    ("[f(1)]", "[f(1)]", []),  # a positional argument: not a call of this format
    ('[f(x="a")] and a remark', "and a remark", [("f", '{"x": "a"}')]),
]


def fed(text: str, cuts: list[int], **kw) -> list:
    parser = PythonicToolParser(**kw)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_whole_and_streamed_at_every_split(case):
    text, content, want = case
    whole = PythonicToolParser().extract(text)
    assert (whole.content, calls(whole)) == (content, want)
    assert all(CALL_ID.fullmatch(c.id) for c in whole.tool_calls)
    for c in whole.tool_calls:
        json.loads(c.arguments)
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    for cuts in splits:
        got = collect(fed(text, cuts))
        assert (got.content, calls(got)) == (content, want), cuts


def test_arguments_stream_one_by_one():
    text = '[f(a=1, b="two", c=[3])]'
    deltas = fed(text, list(range(1, len(text))))
    pieces = [p.arguments for d in deltas for p in d.tool_calls if p.id is None]
    assert pieces == ['{"a": 1', ', "b": "two"', ', "c": [3]', "}"]


def test_cut_by_max_tokens_never_raises():
    text = '[f(a=1, b="long str'
    for cut in range(len(text) + 1):
        got = collect(fed(text, [cut]))
        assert [(c.name, c.arguments) for c in got.tool_calls] == [("f", '{"a": 1')]


def test_only_the_first_call_without_parallel_tool_calls():
    found = PythonicToolParser(parallel_tool_calls=False).extract("[f(x=1), g(y=2)]")
    assert calls(found) == [("f", '{"x": 1}')]
    assert get_tool_parser("pythonic") is PythonicToolParser
