"""The grammar cache's bounds (entries and bytes, least recently used leaving
first) and the compile budget, on asyncllm-tiny's tokenizer, without an engine."""

from __future__ import annotations

import pytest

from asyncllm.default_model import default_model_path
from asyncllm.errors import InvalidRequestError
from asyncllm.structured_output.grammar_cache import GrammarCache
from asyncllm.structured_output.params import StructuredOutputsParams


def cache(**bounds: int) -> GrammarCache:
    return GrammarCache(default_model_path() / "tokenizer.json", [2], 8192, **bounds)


def regex(pattern: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=pattern)


def test_a_compiled_grammar_knows_its_size():
    small = cache().compile(regex("[0-9]{3}"))
    large = cache().compile(regex("a{9000}"))  # a lexer state per prefix of 9,000 bytes
    assert 0 < small.size_bytes < large.size_bytes
    assert large.size_bytes > 1 << 20


def test_the_cache_stays_within_its_bytes_dropping_the_oldest():
    grammars = cache()
    one = grammars.compile(regex("b{9000}")).size_bytes
    bounded = cache(max_bytes=3 * one)
    keys = [regex(f"{c}{{9000}}") for c in "cdefg"]
    for params in keys:
        bounded.compile(params)
        assert bounded.num_bytes <= 3 * one + one // 2  # sizes differ a little by letter
    assert bounded.num_entries < len(keys)
    assert bounded._cached((keys[-1].kind, keys[-1].spec())) is not None
    assert bounded._cached((keys[0].kind, keys[0].spec())) is None


def test_the_cache_stays_within_its_entries():
    bounded = cache(max_entries=2)
    for n in range(5):
        bounded.compile(regex(f"x{{{n + 1}}}"))
    assert bounded.num_entries == 2


def test_a_hit_makes_a_grammar_the_most_recent():
    bounded = cache(max_entries=2)
    first, second, third = (regex(p) for p in ("a", "b", "c"))
    bounded.compile(first)
    bounded.compile(second)
    bounded.compile(first)  # a hit: `second` is now the oldest
    bounded.compile(third)
    assert bounded._cached((first.kind, first.spec())) is not None
    assert bounded._cached((second.kind, second.spec())) is None


@pytest.mark.parametrize("pattern", ["a{1000001}", "(a{1000}){1000}", "(ab){5001}"])
def test_expanded_literals_past_the_budget_are_refused(pattern):
    with pytest.raises(InvalidRequestError, match=r"max_literal_bytes=10000"):
        cache().compile(regex(pattern))


def test_a_deadline_fails_the_compile_that_runs_past_it():
    compiler = cache().compiler
    spec = "(" + "|".join(chr(97 + i % 26) * 9000 + str(i) for i in range(100)) + ")"
    with pytest.raises(ValueError, match="deadline of 0.0 s"):
        compiler.compile("regex", spec, timeout_s=0.001)
    assert compiler.compile("regex", "[0-9]+", timeout_s=10).kind == "regex"


def test_a_bad_deadline_is_refused():
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        cache().compiler.compile("regex", "a", timeout_s=0.0)
