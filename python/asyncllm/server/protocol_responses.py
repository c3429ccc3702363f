"""The OpenAI Responses API request (`POST /v1/responses`) and its translation
into the chat request the server already knows how to run: `instructions` become
the system message, `input` items become chat messages (a `function_call` an
assistant tool call, a `function_call_output` a tool message), function `tools`
and `tool_choice` their chat forms, and `text.format` a `response_format`.

Bad input is a 400 naming the field as the Responses API spells it
(`input[3].type`, `tools[0].type`), never a chat field the client did not send."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from asyncllm.server.protocol import MAX_CONTENT_PARTS, bad_request
from asyncllm.server.protocol_tools import MAX_TOOLS

# Input items one request may send; a static bound so that pydantic stops at the
# first one over (--max-response-input-items then bounds input and history).
MAX_INPUT_ITEMS = 4096
# OpenAI's bounds on `metadata`, which is echoed and stored with the response.
MAX_METADATA_KEYS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True  # OpenAI's default; kept only on a server with --enable-store
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extras
    ignore_eos: bool = False
    structured_outputs: dict[str, Any] | None = None

    def check_metadata(self) -> None:
        """`metadata` within OpenAI's bounds (keys, key and value lengths)."""
        meta = self.metadata or {}
        if len(meta) > MAX_METADATA_KEYS:
            raise bad_request(
                f"metadata has {len(meta)} keys; at most {MAX_METADATA_KEYS} are accepted",
                "metadata",
            )
        for key, value in meta.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise bad_request(
                    f"metadata: keys have at most {MAX_METADATA_KEY_CHARS} characters and "
                    f"values at most {MAX_METADATA_VALUE_CHARS}",
                    "metadata",
                )

    def function_tools(self) -> list[dict[str, Any]] | None:
        """`tools` in their chat form; a 400 for a tool type this server lacks."""
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type") != "function":
                kind = str(tool.get("type"))[:32]
                raise bad_request(
                    f"tools[{i}].type {kind!r} is not supported: only function tools are",
                    "tools",
                )
            fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> Any:
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise bad_request(
                    "tool_choice must be 'none', 'auto', 'required' or "
                    '{"type": "function", "name": ...}',
                    "tool_choice",
                )
            return {"type": "function", "function": {"name": choice["name"]}}
        return choice

    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's `response_format` (None: plain text)."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in (
            "text",
            "json_object",
            "json_schema",
        ):
            raise bad_request(
                "text.format.type must be 'text', 'json_object' or 'json_schema'", "text"
            )
        if fmt["type"] == "text":
            return None
        if fmt["type"] == "json_object":
            return {"type": "json_object"}
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}


def input_messages(request_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `input` as chat messages (without `instructions`)."""
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(request_input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, i))
        elif kind == "function_call":
            call = {
                "id": _text(item, "call_id", i),
                "type": "function",
                "function": {
                    "name": _text(item, "name", i),
                    "arguments": _text(item, "arguments", i),
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            content = output if isinstance(output, str) else _parts_text(output, i)
            messages.append(
                {"role": "tool", "tool_call_id": _text(item, "call_id", i), "content": content}
            )
        elif kind == "reasoning":
            continue  # a model's earlier reasoning is not shown to it again
        else:
            raise bad_request(
                f"input[{i}].type {str(kind)[:32]!r} is not supported: expected message, "
                "function_call, function_call_output or reasoning",
                "input",
            )
    return messages


def _message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = _ROLES.get(str(item.get("role")))
    if role is None:
        raise bad_request(
            f"input[{i}].role must be one of user, system, developer, assistant", "input"
        )
    content = item.get("content")
    if not isinstance(content, str):
        content = _parts_text(content, i)
    return {"role": role, "content": content}


def _parts_text(parts: Any, i: int) -> str:
    if not isinstance(parts, list) or len(parts) > MAX_CONTENT_PARTS:
        raise bad_request(
            f"input[{i}].content must be a string or a list of at most {MAX_CONTENT_PARTS} "
            "text parts",
            "input",
        )
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(
                f"input[{i}].content: part type {str(kind)[:32]!r} is not supported "
                "(text parts only)",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _text(item: dict[str, Any], key: str, i: int) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"input[{i}].{key} must be a string", "input")
    return value


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages that continue from it."""
    return input_messages([_as_input(item) for item in output])


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item["type"] == "message":
        return {"type": "message", "role": "assistant", "content": item["content"]}
    return item


def chat_body(req: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat request that runs `req` over `messages` (history included)."""
    if req.instructions is not None:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": req.function_tools(),
        "tool_choice": req.chat_tool_choice(),
        "parallel_tool_calls": req.parallel_tool_calls,
        "response_format": req.response_format(),
        "stream": req.stream,
        "chat_template_kwargs": req.chat_template_kwargs,
        "structured_outputs": req.structured_outputs,
        "ignore_eos": req.ignore_eos,
    }
    return {k: v for k, v in body.items() if v is not None}


def json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())
