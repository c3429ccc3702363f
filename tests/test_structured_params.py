"""StructuredOutputsParams: exactly one constraint, bounded sizes, clear errors."""

from __future__ import annotations

import pytest

from asyncllm import ConfigError
from asyncllm.structured_output.params import MAX_CHOICES, MAX_SPEC_CHARS, StructuredOutputsParams


def test_each_kind_and_its_spec():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert StructuredOutputsParams(json=schema).kind == "json"
    assert (
        StructuredOutputsParams(json=schema).spec()
        == '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    )
    assert StructuredOutputsParams(regex=r"\d+").spec() == r"\d+"
    assert StructuredOutputsParams(choice=["yes", "no"]).spec() == '["yes", "no"]'
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    assert StructuredOutputsParams(grammar='start: "a"').kind == "grammar"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of .* got none"),
        ({"regex": "a", "choice": ["a"]}, "got regex, choice"),
        ({"json": "{not json"}, r"StructuredOutputsParams.json=.* a JSON schema"),
        ({"json": "[1, 2]"}, "an object"),
        ({"regex": ""}, "regex='' is invalid: must be a non-empty string"),
        ({"choice": []}, "non-empty list"),
        ({"choice": ["ok", 3]}, "choice=3 is invalid"),
        ({"choice": ["x"] * (MAX_CHOICES + 1)}, f"at most {MAX_CHOICES}"),
        ({"grammar": "a" * (MAX_SPEC_CHARS + 1)}, f"at most {MAX_SPEC_CHARS} chars"),
        ({"json_object": "yes"}, "json_object='yes' is invalid: must be a bool"),
    ],
)
def test_bad_constraints_name_the_field(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        StructuredOutputsParams(**kwargs)
