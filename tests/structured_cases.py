"""Constraints the structured-output tests and benches/bench_structured.py share:
30 JSON schemas (objects, nested arrays, enums, ranges, required and optional
fields, anyOf/oneOf, string patterns, $ref), 10 regexes and a Lark grammar, all
bounded so that a random-weight model finishes them within a few dozen tokens."""

from __future__ import annotations

import re
from typing import Any

S = {"type": "string", "maxLength": 6}
INT = {"type": "integer", "minimum": -50, "maximum": 50}
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"a": INT}, "required": ["a"], "additionalProperties": False},
    {
        "type": "object",
        "properties": {"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
        "maxItems": 3,
    },
    {"enum": ["red", "green", "blue"]},
    {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green"]}, "n": INT},
        "required": ["color"],
        "additionalProperties": False,
    },
    {"type": "boolean"},
    {"type": "null"},
    {"type": "integer", "minimum": 10, "maximum": 99},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 5},
    {"type": "string", "pattern": "^[a-z]{2,5}$"},
    {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"anyOf": [INT, {"type": "boolean"}]},
    {
        "anyOf": [
            {
                "type": "object",
                "properties": {"x": INT},
                "required": ["x"],
                "additionalProperties": False,
            },
            {"type": "array", "items": S, "maxItems": 2},
        ]
    },
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "p": {
                "type": "object",
                "properties": {"q": INT},
                "required": ["q"],
                "additionalProperties": False,
            }
        },
        "required": ["p"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"opt": INT, "req": {"type": "boolean"}},
        "required": ["req"],
        "additionalProperties": False,
    },
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": INT},
            "required": ["id"],
            "additionalProperties": False,
        },
        "maxItems": 2,
    },
    {
        "type": "object",
        "properties": {"s": {"type": "string", "minLength": 2, "maxLength": 4}},
        "required": ["s"],
        "additionalProperties": False,
    },
    {"const": "fixed"},
    {
        "type": "object",
        "properties": {"k": {"const": 7}},
        "required": ["k"],
        "additionalProperties": False,
    },
    {"type": "array", "prefixItems": [INT, {"type": "boolean"}], "items": False, "minItems": 2},
    {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 3},
            "b": {"type": "integer", "minimum": 0, "maximum": 3},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
    {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none"]}]},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 5},
    {
        "type": "object",
        "properties": {"d": {"type": "string", "pattern": "^[0-9]{4}$"}},
        "required": ["d"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "err": {"type": "null"}},
        "required": ["ok", "err"],
        "additionalProperties": False,
    },
    {
        "$defs": {
            "pt": {
                "type": "object",
                "properties": {"x": INT, "y": INT},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "array",
        "items": {"$ref": "#/$defs/pt"},
        "maxItems": 2,
    },
]
REGEXES = [
    r"[0-9]{3}",
    r"(yes|no)",
    r"[a-z]{1,6}@[a-z]{1,6}\.com",
    r"\d{4}-\d{2}-\d{2}",
    r"(ab|cd){2,3}",
    r"[A-Z][a-z]{1,5}",
    r"0x[0-9a-f]{4}",
    r"(true|false|null)",
    r"-?[1-9][0-9]{0,2}",
    r"[a-c]{1,3}(,[a-c]{1,3}){0,2}",
]
GRAMMAR = r"""
start: expr
expr: term | term op term | term op term op term
term: NUMBER | "(" NUMBER op NUMBER ")"
op: "+" | "-"
NUMBER: /[1-9][0-9]?/
"""
LARK_EXPR = re.compile(r"[0-9()+\-]+")
