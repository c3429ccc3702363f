"""What a chat request may hand the chat template besides its messages:
`chat_template_kwargs`, checked, and (only on a server started with
--trust-request-chat-template) a `chat_template` of its own.

`chat_template_kwargs` is a side door into the template: a key the server sets
itself (`tools`, `bos_token`, `messages`, ...) would replace the validated value
— 10,000 tools past the 256 that `tools` allows, a `bos_token` of any length —
so those keys are refused, naming the field that sets them; the rest is bounded
in keys, JSON size and nesting before the template sees it.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from asyncllm.chat_template import ChatTemplate
from asyncllm.errors import ConfigError
from asyncllm.server.config import ServerConfig
from asyncllm.server.limits import over_limit
from asyncllm.server.protocol import bad_request

# Keys the server gives the template itself, and where a request sets them.
RESERVED_KWARGS: dict[str, str] = {
    "messages": "the request's `messages`",
    "tools": "the request's `tools` (validated, at most 256)",
    "tool_choice": "the request's `tool_choice`",
    "documents": "nothing: this server passes no documents",
    "add_generation_prompt": "the request's `add_generation_prompt`",
    "bos_token": "the tokenizer",
    "eos_token": "the tokenizer",
    "unk_token": "the tokenizer",
    "pad_token": "the tokenizer",
    "raise_exception": "the server",
    "strftime_now": "the server",
}

# Nesting of one value in chat_template_kwargs (a dict or list in a dict ...).
MAX_KWARGS_DEPTH = 8

# Request templates compiled and kept (by their text), and the longest accepted.
MAX_CACHED_REQUEST_TEMPLATES = 16
MAX_REQUEST_TEMPLATE_CHARS = 64 * 1024

_PARAM = "chat_template_kwargs"


def check_template_kwargs(kwargs: dict[str, Any] | None, config: ServerConfig) -> dict[str, Any]:
    """`kwargs` if no key is one the server sets and it is within the limits
    (--max-chat-template-kwargs keys, --max-chat-template-kwargs-bytes of JSON,
    MAX_KWARGS_DEPTH levels); else a 400 naming the key or the limit."""
    if not kwargs:
        return {}
    for key in kwargs:
        if key in RESERVED_KWARGS:
            raise bad_request(
                f"{_PARAM}.{key[:64]} is set by the server, from {RESERVED_KWARGS[key]}; "
                f"it cannot be given in {_PARAM}",
                _PARAM,
            )
    if len(kwargs) > config.max_chat_template_kwargs:
        raise over_limit(
            _PARAM, "keys", len(kwargs), "max_chat_template_kwargs", config.max_chat_template_kwargs
        )
    depth = _depth(kwargs, MAX_KWARGS_DEPTH)
    if depth > MAX_KWARGS_DEPTH:
        raise bad_request(
            f"{_PARAM} is nested more than {MAX_KWARGS_DEPTH} levels deep; this server "
            f"accepts at most {MAX_KWARGS_DEPTH}",
            _PARAM,
        )
    size = len(json.dumps(kwargs, ensure_ascii=False).encode())
    if size > config.max_chat_template_kwargs_bytes:
        raise over_limit(
            _PARAM,
            "bytes of JSON",
            size,
            "max_chat_template_kwargs_bytes",
            config.max_chat_template_kwargs_bytes,
        )
    return kwargs


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of `value` (a scalar is 0), counted iteratively and
    only up to `limit` + 1, so a deep value costs no more than a shallow one."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        stack.extend((child, depth) for child in children)
    return deepest


class RequestTemplates:
    """The template a chat request renders with: the server's own, or, where the
    server trusts request templates, the request's `chat_template` compiled in
    the same sandbox (the same environment, globals and filters, and the same
    limits on what it renders) and cached by its text."""

    def __init__(
        self,
        default: ChatTemplate | None,
        config: ServerConfig,
        bos_token: str | None,
        eos_token: str | None,
    ) -> None:
        self.default = default
        self.trusted = config.trust_request_chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._compiled: OrderedDict[str, ChatTemplate] = OrderedDict()

    def template_for(self, source: str | None) -> ChatTemplate | None:
        """The template for a request whose `chat_template` is `source`; a 400
        if it gave one and the server does not take them, or it does not
        compile, or it is longer than MAX_REQUEST_TEMPLATE_CHARS."""
        if source is None:
            return self.default
        if not self.trusted:
            raise bad_request(
                "chat_template: this server renders only its own chat template (start it "
                "with --trust-request-chat-template to accept one per request)",
                "chat_template",
            )
        if len(source) > MAX_REQUEST_TEMPLATE_CHARS:
            raise bad_request(
                f"chat_template has {len(source)} characters; this server accepts at most "
                f"{MAX_REQUEST_TEMPLATE_CHARS}",
                "chat_template",
            )
        template = self._compiled.get(source)
        if template is None:
            try:
                template = ChatTemplate(source, self.bos_token, self.eos_token)
            except ConfigError as exc:
                raise bad_request(str(exc), "chat_template") from None
            self._compiled[source] = template
            if len(self._compiled) > MAX_CACHED_REQUEST_TEMPLATES:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(source)
        return template
