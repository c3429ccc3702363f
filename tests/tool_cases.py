"""Tools and helpers shared by the tool-calling tests."""

from __future__ import annotations

import re
from typing import Any

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            # closed, so that a random-weight model's constrained output ends
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def calls(found: Any) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in found.tool_calls]


def reassemble(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Chat chunks added up per choice as a client does: content, tool calls by
    index (id, type and name from the first piece, arguments concatenated)."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        for choice in event["choices"]:
            msg = out.setdefault(
                choice["index"], {"content": None, "tool_calls": {}, "finish": None}
            )
            delta = choice["delta"]
            if delta.get("content"):
                msg["content"] = (msg["content"] or "") + delta["content"]
            for piece in delta.get("tool_calls") or []:
                call = msg["tool_calls"].setdefault(piece["index"], {"function": {"arguments": ""}})
                for key in ("id", "type"):
                    if piece.get(key):
                        call[key] = piece[key]
                fn = piece.get("function") or {}
                if fn.get("name"):
                    call["function"]["name"] = fn["name"]
                call["function"]["arguments"] += fn.get("arguments") or ""
            if choice["finish_reason"] is not None:
                msg["finish"] = choice["finish_reason"]
    for msg in out.values():
        msg["tool_calls"] = [msg["tool_calls"][i] for i in sorted(msg["tool_calls"])]
    return out


def strip_ids(tool_calls: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    for call in tool_calls:
        assert CALL_ID.fullmatch(call["id"]) and call["type"] == "function"
    return [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in tool_calls]
