"""Chat templates: the model's Jinja template (a `--chat-template` file or string,
`chat_template.jinja`, or `tokenizer_config.json`'s entry) rendered the way
transformers' `apply_chat_template` does — a sandboxed environment with
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson` and `strftime_now` — so
prompts match what the model was trained on.

A leaf module: the server's chat endpoint and `LLM.chat` share it. Messages are
checked and put in the shape templates expect (`prepare_messages`): content parts
joined into text, and an assistant's `tool_calls` arguments parsed from JSON text
into objects, as vLLM and transformers hand them to templates that write them with
`tojson`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from asyncllm.errors import ConfigError

# The roles a message may have (OpenAI's; `function` is its older name for tool
# results). Another role is refused, as OpenAI and vLLM refuse it, rather than
# handed to a template that may render it as anything.
ROLES = ("system", "developer", "user", "assistant", "tool", "function")

# Bounds on what one conversation may hold beyond the server's own limits.
MAX_TOOLS = 256
MAX_TOOL_CALLS_PER_MESSAGE = 128


class ChatTemplateError(ValueError):
    """The template could not render these messages (its own `raise_exception`
    included), or a message has the wrong shape; the request is at fault, not the
    server."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


CHAT_TEMPLATE_FILE = "chat_template.jinja"


def resolve_template_source(
    option: str | None,
    tokenizer_config: dict[str, Any],
    directories: Sequence[str | Path] = (),
) -> str | None:
    """The template text, found where transformers finds it: `option` (a file path,
    or an inline template) when given; else `chat_template.jinja` in the first of
    `directories` (the tokenizer's, then the model's) that has one — what current
    `save_pretrained` writes; else `tokenizer_config.json`'s `chat_template` (a
    string, or a list of {name, template}: "default", else the first); else None."""
    if option:
        return _read_option(option)
    for directory in directories:
        path = Path(directory) / CHAT_TEMPLATE_FILE
        if path.is_file():
            return _read_file(path)
    return _from_tokenizer_config(tokenizer_config.get("chat_template"))


def _read_option(option: str) -> str:
    path = Path(option)
    if path.is_file():
        return _read_file(path, "--chat-template")
    if "{{" in option or "{%" in option:
        return option
    raise ConfigError(f"--chat-template {option!r}: no such file (nor an inline template)")


def _read_file(path: Path, what: str = "chat template") -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot read it: {exc}") from exc


def _from_tokenizer_config(source: Any) -> str | None:
    if isinstance(source, list):
        named = [t for t in source if isinstance(t, dict) and isinstance(t.get("template"), str)]
        default = [t for t in named if t.get("name") == "default"]
        source = (default or named or [{}])[0].get("template")
    return source if isinstance(source, str) and source else None


class ChatTemplate:
    """A compiled chat template with the tokenizer's special tokens bound."""

    def __init__(self, source: str, bos_token: str | None, eos_token: str | None) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError(f"the chat template does not compile: {exc}") from exc
        self._specials = {"bos_token": bos_token or "", "eos_token": eos_token or ""}

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """The prompt text; raises ChatTemplateError when the template rejects it."""
        try:
            context = {**self._specials, **(extra or {})}
            context["messages"] = messages
            context["add_generation_prompt"] = add_generation_prompt
            return self._template.render(context)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template failed: {exc}") from exc


def prepare_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI chat messages in the shape a template expects, checked: a role
    (one of ROLES);
    content a string, None (rendered "") or text parts (joined with newlines);
    `tool_calls` only on assistant messages, each `{id, type: "function",
    function: {name, arguments}}` with arguments a JSON object (as text, the
    OpenAI way, or already an object); role "tool" with a `tool_call_id`.
    Raises ChatTemplateError naming the message and field."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ChatTemplateError("messages must be a list of {role, content} objects")
    return [_prepare_message(i, m) for i, m in enumerate(messages)]


def _prepare_message(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise ChatTemplateError(f"{where} must be an object with a role")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise ChatTemplateError(f"{where}.role must be a non-empty string")
    if role not in ROLES:
        raise ChatTemplateError(
            f"{where}.role {role[:32]!r} is not a chat role: expected one of {', '.join(ROLES)}"
        )
    out = dict(message)
    out["content"] = _content_text(message.get("content"), where)
    tool_calls = message.get("tool_calls")
    if tool_calls is not None:
        if role != "assistant":
            raise ChatTemplateError(f"{where}.tool_calls: only assistant messages have tool calls")
        out["tool_calls"] = _prepare_tool_calls(tool_calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise ChatTemplateError(
                f"{where}.tool_call_id: a tool message must name the call it answers"
            )
        if message.get("content") is None:
            raise ChatTemplateError(f"{where}.content: a tool message needs the call's result")
    return out


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ChatTemplateError(f"{where}.content: only text content parts are supported")
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError(f"{where}.content: a text part needs a string 'text'")
            texts.append(part["text"])
        return "\n".join(texts)
    raise ChatTemplateError(f"{where}.content must be a string, a list of text parts or null")


def _prepare_tool_calls(tool_calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(tool_calls, list):
        raise ChatTemplateError(f"{where} must be a list")
    if len(tool_calls) > MAX_TOOL_CALLS_PER_MESSAGE:
        raise ChatTemplateError(
            f"{where} has {len(tool_calls)} calls: at most {MAX_TOOL_CALLS_PER_MESSAGE}"
        )
    out = []
    for j, call in enumerate(tool_calls):
        at = f"{where}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or call.get("type", "function") != "function":
            raise ChatTemplateError(f"{at} must be {{type: 'function', function: {{...}}}}")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise ChatTemplateError(f"{at}.function.name must be a non-empty string")
        arguments = fn.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError as exc:
                raise ChatTemplateError(
                    f"{at}.function.arguments is not valid JSON: {exc}"
                ) from None
        if not isinstance(arguments, dict):
            raise ChatTemplateError(f"{at}.function.arguments must be a JSON object")
        out.append({**call, "type": "function", "function": {**fn, "arguments": arguments}})
    return out


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI function tools (`{type: "function", function: {name, description,
    parameters}}`), checked for shape; ChatTemplateError names the one at fault."""
    if not isinstance(tools, list):
        raise ChatTemplateError("tools must be a list of {type: 'function', function} objects")
    if len(tools) > MAX_TOOLS:
        raise ChatTemplateError(f"tools has {len(tools)} entries: at most {MAX_TOOLS}")
    for k, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or tool.get("type") != "function":
            raise ChatTemplateError(f"tools[{k}] must be {{type: 'function', function: {{...}}}}")
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ChatTemplateError(f"tools[{k}].function.name must be a non-empty string")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ChatTemplateError(f"tools[{k}].function.parameters must be a JSON schema object")
    return list(tools)
