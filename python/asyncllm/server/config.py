"""`ServerConfig`: the server's own settings (the engine's are `EngineArgs`),
among them a bound on every size a client controls and a timeout on every wait a
client can cause. Each limit is an `asyncllm serve` flag of the same name
(`max_n` is `--max-n`); `LIMIT_HELP` documents them and the CLI is generated from
it, so a limit cannot lack a flag."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields

from asyncllm.errors import ConfigError
from asyncllm.pooling_params import POOLING_TYPES

MiB = 1 << 20

LIMIT_HELP: dict[str, str] = {
    "max_request_body_bytes": "largest request body; checked from Content-Length before "
    "the body is read, and while it streams in (HTTP 413)",
    "max_prompt_chars": "characters in one prompt (for chat: in all messages together)",
    "max_prompt_tokens": "tokens in one prompt (0: the model's context length)",
    "max_prompts_per_request": "prompts in one /v1/completions request",
    "max_n": "choices per prompt (n)",
    "max_stop_strings": "stop strings per request",
    "max_stop_string_chars": "characters in one stop string",
    "max_logit_bias": "entries in logit_bias",
    "max_stop_token_ids": "entries in stop_token_ids",
    "max_chat_messages": "messages in one chat request",
    "max_chat_template_kwargs": "keys in chat_template_kwargs (keys the server sets itself, "
    "such as tools, bos_token or messages, are refused)",
    "max_chat_template_kwargs_bytes": "bytes of chat_template_kwargs as JSON",
    "max_header_bytes": "bytes of a request's line and headers (HTTP 431)",
    "max_response_bytes": "the response size a request may build, estimated before it "
    "runs from n, prompts, max_tokens, echo and logprobs",
    "header_timeout": "seconds a client has to send a request's headers",
    "body_timeout": "seconds a client has to send a request's body (HTTP 408)",
    "stream_idle_timeout": "seconds a response may wait on a client that does not read "
    "before the connection is closed and the request aborted",
    "max_connections": "open connections; more are answered 503 and closed",
    "max_stored_responses": "responses kept by /v1/responses with store (with "
    "--enable-store; the oldest go first)",
    "max_response_store_bytes": "bytes of stored responses together (with --enable-store)",
    "max_response_input_items": "items in a /v1/responses input (with the conversation "
    "of previous_response_id) or messages in a /v1/messages request",
    "max_embedding_inputs": "inputs in one /v1/embeddings request",
    "max_embedding_tokens": "tokens of all the inputs of one /v1/embeddings request together",
}


@dataclass
class ServerConfig:
    """The server's own settings. Every limit is positive; `validate` says which
    one is not."""

    served_model_names: list[str]
    api_key: str | None = None
    max_concurrent_requests: int | None = None  # sequences (prompts x n) running at once
    chat_template: str | None = None
    # a request's own `chat_template` is rendered (in the same sandbox) only if set
    trust_request_chat_template: bool = False
    tool_call_parser: str = "hermes"  # reads tool calls in model output (tool_parsers)
    reasoning_parser: str | None = None  # splits `<think>` reasoning off (reasoning/)
    # vLLM's structured_outputs_config.enable_in_reasoning: with a reasoning parser,
    # a constraint covers the reasoning too (off: it applies to the answer only)
    structured_outputs_in_reasoning: bool = False
    # /v1/responses keeps responses (store, previous_response_id) only when set
    enable_store: bool = False
    # /v1/embeddings: how the final hidden states are pooled ("last" or "mean"),
    # and whether embeddings are scaled to unit length
    embedding_pooling: str = "last"
    embedding_normalize: bool = True
    shutdown_timeout: float = 10.0
    stats_interval: float = 10.0
    ui: bool = True  # the browser page at / and /dashboard (`--no-ui` turns it off)
    # the path prefix a reverse proxy serves this server under ("" or "/a/b")
    root_path: str = ""
    # LoRA adapters served from the start, (name, PEFT directory), picked by a
    # request's `model`; and whether /v1/load_lora_adapter and
    # /v1/unload_lora_adapter may change them at run time (off unless asked for)
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    allow_runtime_lora_updating: bool = False
    # -- limits (see LIMIT_HELP) --
    max_request_body_bytes: int = 16 * MiB
    max_prompt_chars: int = 1 * MiB
    max_prompt_tokens: int = 0
    max_prompts_per_request: int = 256
    max_n: int = 128
    max_stop_strings: int = 16
    max_stop_string_chars: int = 1024
    max_logit_bias: int = 300
    max_stop_token_ids: int = 256
    max_chat_messages: int = 1024
    max_chat_template_kwargs: int = 32
    max_chat_template_kwargs_bytes: int = 16 * 1024
    max_header_bytes: int = 16 * 1024
    max_response_bytes: int = 32 * MiB
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    stream_idle_timeout: float = 30.0
    max_connections: int = 1024
    max_stored_responses: int = 1000
    max_response_store_bytes: int = 64 * MiB
    max_response_input_items: int = 1024
    # OpenAI's own bounds: 2048 inputs, 300k tokens per request
    max_embedding_inputs: int = 2048
    max_embedding_tokens: int = 300_000

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        for name in LIMIT_HELP:
            value = getattr(self, name)
            minimum = 0 if name == "max_prompt_tokens" else 1
            if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{flag}={value!r} is invalid: must be a number >= {minimum}")
        if self.embedding_pooling not in POOLING_TYPES:
            raise ConfigError(
                f"--embedding-pooling={self.embedding_pooling!r} is invalid: must be one of "
                + ", ".join(POOLING_TYPES)
            )
        if self.max_concurrent_requests is not None and self.max_concurrent_requests < 1:
            raise ConfigError("--max-concurrent-requests must be >= 1")
        if self.root_path and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ConfigError(
                f"--root-path={self.root_path!r} is invalid: must start with '/' and not "
                "end with one (e.g. /llm)"
            )


# vLLM's --structured-outputs-config keys asyncllm reads, and the backends it
# accepts (llguidance is the only one: vLLM calls it "guidance")
_STRUCTURED_KEYS = ("backend", "enable_in_reasoning")
_BACKENDS = ("auto", "guidance")


def parse_structured_outputs_config(text: str | None) -> bool:
    """`--structured-outputs-config` JSON (vLLM's) -> enable_in_reasoning; a
    ConfigError names a key or value asyncllm does not take."""
    if not text:
        return False
    flag = "--structured-outputs-config"
    try:
        body = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ConfigError(f"{flag} must be a JSON object, e.g. '{{\"enable_in_reasoning\": true}}'")
    for key in body:
        if key not in _STRUCTURED_KEYS:
            raise ConfigError(f"{flag}: unknown key {key!r}; known: {', '.join(_STRUCTURED_KEYS)}")
    if body.get("backend", "auto") not in _BACKENDS:
        raise ConfigError(
            f"{flag}: backend={body['backend']!r} is not available: asyncllm's is "
            "llguidance ('guidance' or 'auto')"
        )
    enable = body.get("enable_in_reasoning", False)
    if not isinstance(enable, bool):
        raise ConfigError(f"{flag}: enable_in_reasoning must be true or false")
    return enable


def limit_fields() -> list[tuple[str, type, object]]:
    """(name, int or float, default) of every limit, in LIMIT_HELP's order."""
    by_name = {f.name: f for f in fields(ServerConfig)}
    out: list[tuple[str, type, object]] = []
    for name in LIMIT_HELP:
        f = by_name[name]
        kind: type = float if str(f.type).startswith("float") else int
        out.append((name, kind, f.default))
    return out
