"""Reasoning parsers without a server: `<think>…</think>` split off whole and
streamed at every split (tags cut across deltas included), and the output
parser that reads tool calls from the answer after the reasoning — streamed at
every split, it adds up to the non-streamed reading."""

from __future__ import annotations

import pytest
from tool_cases import CALL_ID, calls

from asyncllm.errors import ConfigError
from asyncllm.server.output_parser import OutputDelta, OutputParser
from asyncllm.server.reasoning import get_reasoning_parser, reasoning_parser_names
from asyncllm.server.tool_parsers.base import ParserDelta, collect
from asyncllm.server.tool_parsers.hermes import HermesToolParser

# (text, deepseek_r1's (reasoning, content), qwen3's (reasoning, content))
THINK_CASES = [
    ("<think>a plan</think>\n\nThe answer.", ("a plan", "The answer."), ("a plan", "The answer.")),
    ("a plan</think>The answer.", ("a plan", "The answer."), (None, "a plan</think>The answer.")),
    ("  <think>\nüñí 🤔 </think>  ok", ("\nüñí 🤔 ", "ok"), ("\nüñí 🤔 ", "ok")),
    (
        "Just an answer <think> in it",
        ("Just an answer <think> in it", ""),
        (None, "Just an answer <think> in it"),
    ),
    ("<think>cut by max_tokens", ("cut by max_tokens", ""), ("cut by max_tokens", "")),
    ("<think></think>", (None, ""), (None, "")),
    ("<thin", ("<thin", ""), (None, "<thin")),
    (
        "<think>a < b </thin </think>x</think>",
        ("a < b </thin ", "x</think>"),
        ("a < b </thin ", "x</think>"),
    ),
    ("", (None, ""), (None, "")),
]


def fed(parser, text: str, cuts: list[int]) -> list:
    """The deltas of `text` fed in pieces cut at `cuts`, the last with finish()."""
    bounds = [0, *cuts, len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    return [parser.feed(p) for p in pieces[:-1]] + [parser.finish(pieces[-1])]


def every_split(text: str) -> list[list[int]]:
    """Each single cut, and a cut between every two characters."""
    return [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]


@pytest.mark.parametrize("case", THINK_CASES, ids=range(len(THINK_CASES)))
@pytest.mark.parametrize("name", ["deepseek_r1", "qwen3"])
def test_think_whole_and_streamed_at_every_split(case, name):
    text = case[0]
    want = case[1] if name == "deepseek_r1" else case[2]
    cls = get_reasoning_parser(name)
    assert cls is not None
    assert cls().extract(text) == want
    for cuts in every_split(text):
        deltas = fed(cls(), text, cuts)
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        assert (reasoning or None, content) == want, cuts


def test_reasoning_is_released_as_it_comes():
    """Only a tail that could begin `</think>` is held back."""
    parser = get_reasoning_parser("qwen3")()  # type: ignore[misc]
    assert parser.feed("<think>").reasoning == ""
    assert parser.feed("step one").reasoning == "step one"
    assert parser.feed(" </th").reasoning == " "
    assert parser.feed("ink>\nok").content == "ok"


def test_unknown_parser_names_the_known_ones():
    assert reasoning_parser_names() == ["deepseek_r1", "qwen3"]
    assert get_reasoning_parser(None) is None
    with pytest.raises(ConfigError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("o1")


# -- reasoning, then tool calls ---------------------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
NESTED = (
    '<tool_call>\n{"name": "f", "arguments": {"q": "say \\"</tool_call>\\" \\\\ ok",'
    ' "n": {"a": [1, {"b": "}"}]}}}\n</tool_call>'
)
# (text, reasoning, content, [(name, arguments)]) with qwen3 + hermes
MIXED = [
    (
        f"<think>I should call <tool_call> a tool</think>\n{CALL}",
        "I should call <tool_call> a tool",
        None,
        [("get_weather", '{"city": "Zürich"}')],
    ),
    (
        f"<think>two</think>Sure.\n{CALL}\n{NESTED}",
        "two",
        "Sure.",
        [
            ("get_weather", '{"city": "Zürich"}'),
            ("f", '{"q": "say \\"</tool_call>\\" \\\\ ok", "n": {"a": [1, {"b": "}"}]}}'),
        ],
    ),
    ("<think>only thinking, cut", "only thinking, cut", "", []),
    ("no reasoning, a plain answer", None, "no reasoning, a plain answer", []),
    (
        f"<think>日本語</think>{NESTED}",
        "日本語",
        None,
        [("f", '{"q": "say \\"</tool_call>\\" \\\\ ok", "n": {"a": [1, {"b": "}"}]}}')],
    ),
]


def parser() -> OutputParser:
    reasoning = get_reasoning_parser("qwen3")
    assert reasoning is not None
    return OutputParser(reasoning(), HermesToolParser())


def _collect(deltas: list[OutputDelta]) -> tuple[str | None, object]:
    found = collect([ParserDelta(d.content, d.tool_calls) for d in deltas])
    return "".join(d.reasoning for d in deltas) or None, found


@pytest.mark.parametrize("case", MIXED, ids=range(len(MIXED)))
def test_reasoning_then_calls_whole_and_at_every_split(case):
    text, reasoning, content, want = case
    whole = parser().extract(text)
    assert (whole.reasoning, whole.content, calls(whole)) == (reasoning, content, want)
    assert all(CALL_ID.fullmatch(c.id) for c in whole.tool_calls)
    for cuts in every_split(text):
        deltas = fed(parser(), text, cuts)
        got_reasoning, got = _collect(deltas)
        assert (got_reasoning, got.content, calls(got)) == (reasoning, content, want), cuts
        # no markup of a call in the content, and none inside the reasoning is a call
        assert "<tool_call>" not in "".join(d.content for d in deltas) or not want


def test_a_call_cut_by_max_tokens_after_reasoning_never_breaks():
    """Cut inside a call's arguments: whole, the block is content; streamed the
    name may already be out (it cannot be taken back), but the reasoning is
    whole, nothing raises, and no call has arguments from the reasoning."""
    text = '<think>plan</think><tool_call>\n{"name": "f", "arguments": {"a": "long'
    assert parser().extract(text).reasoning == "plan"
    for cuts in every_split(text):
        got_reasoning, got = _collect(fed(parser(), text, cuts))
        assert got_reasoning == "plan"
        assert [c.name for c in got.tool_calls] in ([], ["f"])
        assert all("plan" not in c.arguments for c in got.tool_calls)
