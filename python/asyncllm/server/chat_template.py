"""Chat templates: the model's Jinja template (a `--chat-template` file or string,
`chat_template.jinja`, or `tokenizer_config.json`'s entry) rendered the way
transformers' `apply_chat_template` does — a sandboxed environment with
`trim_blocks`/`lstrip_blocks`, `raise_exception`, `tojson` and `strftime_now` — so
prompts match what the model was trained on."""

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


class ChatTemplateError(ValueError):
    """The template could not render these messages (its own `raise_exception`
    included); the request is at fault, not the server."""


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
