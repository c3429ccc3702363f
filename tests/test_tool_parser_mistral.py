"""The `mistral` tool parser without a server: whole outputs in both of Mistral's
forms, and every output streamed at every split adding up to the whole reading."""

from __future__ import annotations

import pytest
from tool_cases import CALL_ID, calls

from asyncllm.server.tool_parsers import get_tool_parser
from asyncllm.server.tool_parsers.base import collect
from asyncllm.server.tool_parsers.mistral import MistralToolParser

NESTED = '{"q": "say \\"}\\" [ARGS] ok", "n": {"a": [1, {"b": "}"}]}, "u": "Zürich 🌍"}'
# (text, content, [(name, arguments)])
CASES = [
    (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        None,
        [("get_weather", '{"city": "Paris"}')],
    ),
    (
        f'[TOOL_CALLS] [{{"name": "f", "arguments": {NESTED}}}, '
        '{"name": "g", "arguments": {}}]',
        None,
        [("f", NESTED), ("g", "{}")],
    ),
    # v11+: name[ARGS]{...}, one tag per call
    (
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"zone": 2}',
        None,
        [("get_weather", '{"city": "Paris"}'), ("get_time", '{"zone": 2}')],
    ),
    (f"[TOOL_CALLS]f[ARGS]{NESTED}", None, [("f", NESTED)]),
    # content before the calls
    (
        'Let me look. [TOOL_CALLS]get_time[ARGS]{"zone": 1}',
        "Let me look. ",
        [("get_time", '{"zone": 1}')],
    ),
    # not calls: content as written
    ("The weather is fine.", "The weather is fine.", []),
    ("[TOOL_CALLS] no call here", "[TOOL_CALLS] no call here", []),
    ('[TOOL_CALLS][{"answer": 42}]', '[TOOL_CALLS][{"answer": 42}]', []),
    ("a [TOOL_CA", "a [TOOL_CA", []),
    # a call, then text: the text is content
    ('[TOOL_CALLS]f[ARGS]{"x": 1} and some words', "and some words", [("f", '{"x": 1}')]),
]


def fed(text: str, cuts: list[int], parallel: bool = True) -> list:
    parser = MistralToolParser(parallel)
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


@pytest.mark.parametrize("case", CASES, ids=range(len(CASES)))
def test_whole_and_streamed_at_every_split(case):
    text, content, want = case
    whole = MistralToolParser().extract(text)
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
    text = CASES[3][0]
    deltas = fed(text, list(range(1, len(text))))
    pieces = [p for d in deltas for p in d.tool_calls if p.index == 0 and p.id is None]
    assert len(pieces) > 10 and "".join(p.arguments for p in pieces) == NESTED


def test_a_call_cut_by_max_tokens_keeps_its_pieces_and_never_raises():
    text = '[TOOL_CALLS]f[ARGS]{"a": "long'
    for cut in range(len(text) + 1):
        got = collect(fed(text, [cut]))
        assert [c.name for c in got.tool_calls] == ["f"]
        assert got.tool_calls[0].arguments == '{"a": "long'


def test_only_the_first_call_without_parallel_tool_calls():
    text = CASES[2][0]
    for cuts in ([], list(range(1, len(text)))):
        got = collect(fed(text, cuts, parallel=False))
        assert calls(got) == [("get_weather", '{"city": "Paris"}')] and got.content is None
    assert get_tool_parser("mistral") is MistralToolParser
