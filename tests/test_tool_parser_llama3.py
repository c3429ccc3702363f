"""The `llama3_json` tool parser without a server: whole outputs, and every
output streamed at every split adding up to the whole reading."""

from __future__ import annotations

import pytest
from tool_cases import CALL_ID, calls

from asyncllm.server.tool_parsers import get_tool_parser
from asyncllm.server.tool_parsers.base import collect
from asyncllm.server.tool_parsers.llama3_json import Llama3JsonToolParser

NESTED = '{"q": "say \\"}\\" ; ok", "n": {"a": [1, {"b": "}"}]}, "u": "Zürich 🌍"}'
# (text, content, [(name, arguments)])
CASES = [
    (
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        f'<|python_tag|>{{"name": "f", "arguments": {NESTED}}}; '
        '{"name": "g", "parameters": {}}',
        None,
        [("f", NESTED), ("g", "{}")],
    ),
    # keys in the other order: arguments re-serialised
    ('{"parameters": {"x": 1}, "name": "f"}', None, [("f", '{"x": 1}')]),
    # not calls: content as written
    ("The weather is fine.", "The weather is fine.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ("  <|python", "  <|python", []),
    # a call, then text: the text is content
    ('{"name": "f", "parameters": {}} and then some words', "and then some words", [("f", "{}")]),
]


def fed(text: str, cuts: list[int]) -> list:
    parser = Llama3JsonToolParser()
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_whole_and_streamed_at_every_split(case):
    text, content, want = case
    whole = Llama3JsonToolParser().extract(text)
    assert (whole.content, calls(whole)) == (content, want)
    assert all(CALL_ID.fullmatch(c.id) for c in whole.tool_calls)
    splits = [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]
    for cuts in splits:
        deltas = fed(text, cuts)
        got = collect(deltas)
        assert (got.content, calls(got)) == (content, want), cuts
        for index in range(len(got.tool_calls)):
            pieces = [p for d in deltas for p in d.tool_calls if p.index == index]
            assert pieces[0].id and pieces[0].name and pieces[0].arguments == ""
            assert all(p.id is None for p in pieces[1:])


def test_arguments_stream_as_they_form():
    text = CASES[1][0]
    deltas = fed(text, list(range(1, len(text))))
    pieces = [p for d in deltas for p in d.tool_calls if p.index == 0 and p.id is None]
    assert len(pieces) > 10 and "".join(p.arguments for p in pieces) == NESTED


def test_a_call_cut_by_max_tokens_keeps_its_pieces_and_never_raises():
    text = '{"name": "f", "parameters": {"a": "long'
    for cut in range(len(text) + 1):
        got = collect(fed(text, [cut]))
        assert [c.name for c in got.tool_calls] == ["f"]
        assert got.tool_calls[0].arguments == '{"a": "long'


def test_only_the_first_call_without_parallel_tool_calls():
    text = '{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'
    found = Llama3JsonToolParser(parallel_tool_calls=False).extract(text)
    assert calls(found) == [("f", "{}")]
    assert get_tool_parser("llama3_json") is Llama3JsonToolParser
