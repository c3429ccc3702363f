"""`asyncllm serve`: the OpenAI-compatible HTTP server over one engine."""

from __future__ import annotations

import argparse
from typing import Any

from asyncllm.cli.args import add_engine_args, add_limit_args, engine_args_from
from asyncllm.errors import ConfigError
from asyncllm.placement import placement


def add_parser(sub: Any) -> None:
    """`serve`: MODEL, the engine flags, the server's own and its limits."""
    p = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port to bind (default: 8000)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' (all but /health); default: "
        "$ASYNCLLM_API_KEY, which keeps the key out of the process list",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model path)",
    )
    s.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=None,
        help="sequences (prompts x n) generated at once; requests beyond get HTTP 429 "
        "(default: no limit)",
    )
    s.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template: a file, or the template itself (default: the model's "
        "chat_template.jinja, else tokenizer_config.json's chat_template)",
    )
    s.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a request's own chat_template (in the same sandbox, with the same "
        "limits); without it a request that sends one gets HTTP 400",
    )
    s.add_argument(
        "--tool-call-parser",
        default="hermes",
        help="how tool calls are read from the model's output with tool_choice 'auto' "
        "(known: hermes, for Hermes and Qwen models; llama3_json, for Llama 3.x; "
        "pythonic, [f(x=1), ...] lists; mistral, after [TOOL_CALLS]; qwen3_coder, "
        "<function=NAME><parameter=KEY> blocks; default: hermes)",
    )
    _add_reasoning_args(s)
    s.add_argument(
        "--enable-store",
        action="store_true",
        help="keep /v1/responses results asked to be stored (store, previous_response_id, "
        "GET/DELETE /v1/responses/ID), in memory, per API key, within "
        "--max-stored-responses and --max-response-store-bytes",
    )
    _add_embedding_args(s)
    s.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may finish after SIGTERM before being aborted",
    )
    s.add_argument(
        "--stats-interval",
        type=float,
        default=10.0,
        help="seconds between stats log lines while busy (0: never)",
    )
    _add_lora_args(s)
    _add_page_args(s)
    s.add_argument("--log-level", default="info", help="server log level (default: info)")
    s.add_argument("--access-log", action="store_true", help="log every HTTP request")
    add_limit_args(p)


def _add_lora_args(s: Any) -> None:
    """Which LoRA adapters are served, and whether clients may change them."""
    s.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) to serve, each picked by a request's model "
        "field (needs --enable-lora)",
    )
    s.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API "
        "key; needs --enable-lora)",
    )


def _add_reasoning_args(s: Any) -> None:
    """How a reasoning model's output is read, and what a constraint covers."""
    s.add_argument(
        "--reasoning-parser",
        default=None,
        help="split a reasoning model's <think>...</think> off its answer: into "
        "reasoning_content (chat), reasoning items (responses), thinking blocks "
        "(messages) (known: deepseek_r1, qwen3; default: none)",
    )
    s.add_argument(
        "--structured-outputs-config",
        default=None,
        help='vLLM\'s structured-output settings as JSON: {"enable_in_reasoning": true} '
        "makes a request's constraint cover the reasoning too (default: with "
        "--reasoning-parser it applies to the answer after the reasoning only)",
    )


def _add_embedding_args(s: Any) -> None:
    """How /v1/embeddings pools and scales."""
    s.add_argument(
        "--embedding-pooling",
        choices=["last", "mean"],
        default="last",
        help="how /v1/embeddings pools the model's final hidden states: the last prompt "
        "token's (default) or the mean over the prompt's tokens",
    )
    s.add_argument(
        "--no-embedding-normalize",
        dest="embedding_normalize",
        action="store_false",
        help="answer /v1/embeddings with the pooled vectors as they are (default: scaled to "
        "unit length)",
    )


def _add_page_args(s: Any) -> None:
    """The browser page's flags, and the path prefix its URLs (and the API's) live under."""
    s.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the browser page (chat at /, live charts at /dashboard)",
    )
    s.add_argument(
        "--root-path",
        default="",
        help="the path prefix a reverse proxy serves this server under, e.g. /llm (the "
        "proxy strips it; default: none)",
    )


def run(ns: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; the exit status. A bad server setting exits naming it."""
    from asyncllm import envs
    from asyncllm.server.config import (
        LIMIT_HELP,
        ServerConfig,
        parse_structured_outputs_config,
    )
    from asyncllm.server.launch import run_server
    from asyncllm.server.lora import parse_lora_modules
    from asyncllm.server.reasoning import get_reasoning_parser
    from asyncllm.server.tool_parsers import get_tool_parser

    try:
        config = ServerConfig(
            served_model_names=ns.served_model_name or [ns.model],
            api_key=ns.api_key or envs.api_key(),
            max_concurrent_requests=ns.max_concurrent_requests,
            chat_template=ns.chat_template,
            trust_request_chat_template=ns.trust_request_chat_template,
            tool_call_parser=ns.tool_call_parser,
            reasoning_parser=ns.reasoning_parser,
            structured_outputs_in_reasoning=parse_structured_outputs_config(
                ns.structured_outputs_config
            ),
            enable_store=ns.enable_store,
            embedding_pooling=ns.embedding_pooling,
            embedding_normalize=ns.embedding_normalize,
            shutdown_timeout=ns.shutdown_timeout,
            stats_interval=ns.stats_interval,
            ui=ns.ui,
            root_path=ns.root_path,
            lora_modules=parse_lora_modules(ns.lora_modules),
            allow_runtime_lora_updating=ns.allow_runtime_lora_updating,
            **{name: getattr(ns, name) for name in LIMIT_HELP},
        )
        if (config.lora_modules or config.allow_runtime_lora_updating) and not ns.enable_lora:
            raise ConfigError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        get_tool_parser(config.tool_call_parser)
        get_reasoning_parser(config.reasoning_parser)
    except ConfigError as exc:
        raise SystemExit(f"asyncllm serve: {exc}") from None
    return run_server(
        placement(engine_args_from(ns), "serve"),
        config,
        ns.host,
        ns.port,
        log_level=ns.log_level,
        access_log=ns.access_log,
    )
