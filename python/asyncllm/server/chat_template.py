"""The server's chat templates: the shared leaf `asyncllm.chat_template` (which
`LLM.chat` uses too), re-exported where the server has always found it."""

from asyncllm.chat_template import (
    CHAT_TEMPLATE_FILE,
    ChatTemplate,
    ChatTemplateError,
    check_tools,
    prepare_messages,
    resolve_template_source,
)

__all__ = [
    "CHAT_TEMPLATE_FILE",
    "ChatTemplate",
    "ChatTemplateError",
    "check_tools",
    "prepare_messages",
    "resolve_template_source",
]
