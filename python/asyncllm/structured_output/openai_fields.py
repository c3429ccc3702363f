"""Output constraints in OpenAI request bodies: `response_format` (`json_object`,
`json_schema`) and vLLM's `structured_outputs` extension (json, regex, choice,
grammar), both turned into one `StructuredOutputsParams` or a 400 naming the
field. Whether a schema, regex or grammar compiles is the engine's to say (also
a 400, from the front end's check)."""

from __future__ import annotations

from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.structured_output.params import KINDS, StructuredOutputsParams


class FormatError(ValueError):
    """A bad constraint field: `protocol` answers it with a 400 naming `param`."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def bad_request(message: str, param: str) -> FormatError:
    return FormatError(message, param)


def _params(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ConfigError as exc:
        raise bad_request(f"{param}: {exc}", param) from None


def from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    """OpenAI's `response_format`: text (none), json_object, or json_schema with
    `{"name": ..., "schema": {...}, "strict": ...}` (name and strict change
    nothing: the output always matches the schema)."""
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return _params({"json_object": True}, "response_format")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format: type json_schema needs a json_schema object", "response_format"
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict | bool):
            raise bad_request(
                "response_format: json_schema.schema must be an object", "response_format"
            )
        return _params({"json": schema if isinstance(schema, dict) else {}}, "response_format")
    raise bad_request(
        f"response_format: type {kind!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


def from_body(
    response_format: dict[str, Any] | None, structured_outputs: dict[str, Any] | None
) -> StructuredOutputsParams | None:
    """The request's constraint, from at most one of the two fields."""
    rf = from_response_format(response_format) if response_format else None
    if structured_outputs is None:
        return rf
    if rf is not None:
        raise bad_request(
            "give either response_format or structured_outputs, not both", "structured_outputs"
        )
    unknown = set(structured_outputs) - set(KINDS)
    if unknown:
        raise bad_request(
            f"structured_outputs: unknown field(s) {sorted(unknown)}; one of {list(KINDS)}",
            "structured_outputs",
        )
    return _params(dict(structured_outputs), "structured_outputs")
