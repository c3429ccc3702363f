"""The Anthropic Messages API request (`POST /v1/messages`), its translation into
the chat request the server runs, and Anthropic's error shape.

- `system` (a string or text blocks) becomes the system message;
- a user message's `text` blocks its content and each `tool_result` block a tool
  message (before the user's text, as the results answer the previous turn);
- an assistant message's `text` blocks its content and `tool_use` blocks its
  tool calls (`input` as JSON arguments); `thinking` blocks are not shown again;
- `tools` (`name`, `description`, `input_schema`) become function tools, and
  `tool_choice` `auto` / `any` / `tool` / `none` chat's auto / required / a named
  function / none (`disable_parallel_tool_use` is `parallel_tool_calls: false`).

Bad input is a 400 in Anthropic's shape naming the field as Anthropic spells it."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from asyncllm.server.protocol import MAX_CONTENT_PARTS, APIError, bad_request
from asyncllm.server.protocol_responses import MAX_INPUT_ITEMS
from asyncllm.server.protocol_tools import MAX_TOOLS

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error_body(exc: APIError) -> bytes:
    """`{"type": "error", "error": {"type", "message"}}`, Anthropic's error shape."""
    kind = _ERROR_TYPES.get(exc.status, "api_error")
    return json.dumps({"type": "error", "error": {"type": kind, "message": exc.message}}).encode()


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_INPUT_ITEMS)]
    system: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: dict[str, Any] | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # {"type": "enabled" | "disabled"}: the template's `enable_thinking` (Qwen3's)
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extras
    ignore_eos: bool = False
    structured_outputs: dict[str, Any] | None = None

    def function_tools(self) -> list[dict[str, Any]] | None:
        if not self.tools:
            return None
        out = []
        for i, tool in enumerate(self.tools):
            if tool.get("type", "custom") != "custom" or not isinstance(tool.get("name"), str):
                kind = str(tool.get("type"))[:40]
                raise bad_request(
                    f"tools.{i}: tool type {kind!r} is not supported: only custom tools "
                    "(name, description, input_schema) are",
                    "tools",
                )
            fn: dict[str, Any] = {"name": tool["name"]}
            if "description" in tool:
                fn["description"] = tool["description"]
            if "input_schema" in tool:
                fn["parameters"] = tool["input_schema"]
            out.append({"type": "function", "function": fn})
        return out

    def chat_tool_choice(self) -> tuple[Any, bool]:
        """(chat's tool_choice, parallel_tool_calls)."""
        choice = self.tool_choice
        if choice is None:
            return None, True
        parallel = not choice.get("disable_parallel_tool_use", False)
        kind = choice.get("type")
        if kind in ("auto", "none"):
            return kind, parallel
        if kind == "any":
            return "required", parallel
        if kind == "tool" and isinstance(choice.get("name"), str):
            return {"type": "function", "function": {"name": choice["name"]}}, parallel
        raise bad_request(
            "tool_choice.type must be auto, any, tool (with a name) or none", "tool_choice"
        )


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a message request without `max_tokens`."""

    max_tokens: int = 1


def system_text(system: str | list[dict[str, Any]] | None) -> str | None:
    if system is None or isinstance(system, str):
        return system
    return "".join(_block_text(b, "system") for b in system)


def _block_text(block: dict[str, Any], where: str) -> str:
    if block.get("type") != "text" or not isinstance(block.get("text"), str):
        kind = str(block.get("type"))[:32]
        raise bad_request(f"{where}: block type {kind!r} is not supported here", where)
    return str(block["text"])


def chat_messages(req: MessagesRequest) -> list[dict[str, Any]]:
    """The request's system and messages as chat messages."""
    out: list[dict[str, Any]] = []
    system = system_text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(req.messages):
        role = message.get("role")
        content = message.get("content")
        where = f"messages.{i}"
        if role not in ("user", "assistant"):
            raise bad_request(f"{where}.role must be user or assistant", "messages")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list) and len(content) <= MAX_CONTENT_PARTS:
            out += _blocks(role, content, where)
        else:
            raise bad_request(
                f"{where}.content must be a string or at most {MAX_CONTENT_PARTS} blocks",
                "messages",
            )
    return out


def _blocks(role: str, blocks: list[Any], where: str) -> list[dict[str, Any]]:
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            args = json.dumps(block.get("input") or {}, ensure_ascii=False)
            fn = {"name": str(block.get("name")), "arguments": args}
            calls.append({"id": str(block.get("id")), "type": "function", "function": fn})
        elif kind == "tool_result" and role == "user":
            content = block.get("content", "")
            if isinstance(content, list) and len(content) > MAX_CONTENT_PARTS:
                raise bad_request(
                    f"{at}.content has {len(content)} blocks; at most {MAX_CONTENT_PARTS} "
                    "are accepted",
                    "messages",
                )
            if isinstance(content, list):
                content = "".join(_block_text(b, at) for b in content)
            results.append(
                {"role": "tool", "tool_call_id": str(block.get("tool_use_id")), "content": content}
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        else:
            raise bad_request(
                f"{at}: block type {str(kind)[:32]!r} is not supported in a {role} message",
                "messages",
            )
    out = results
    if texts or calls or not results:
        message: dict[str, Any] = {"role": role, "content": "".join(texts) if texts else None}
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        out = [*results, message]
    return out


def template_kwargs(req: MessagesRequest) -> dict[str, Any] | None:
    """`chat_template_kwargs`, with `thinking` as `enable_thinking` unless given."""
    kwargs = dict(req.chat_template_kwargs or {})
    kind = (req.thinking or {}).get("type")
    if kind in ("enabled", "disabled") and "enable_thinking" not in kwargs:
        kwargs["enable_thinking"] = kind == "enabled"
    return kwargs or None


def chat_body(req: MessagesRequest) -> dict[str, Any]:
    """The chat request that runs `req`."""
    choice, parallel = req.chat_tool_choice()
    body: dict[str, Any] = {
        "model": req.model,
        "messages": chat_messages(req),
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": req.function_tools(),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "stream": req.stream,
        "chat_template_kwargs": template_kwargs(req),
        "structured_outputs": req.structured_outputs,
        "ignore_eos": req.ignore_eos,
    }
    return {k: v for k, v in body.items() if v is not None}
