"""The ASGI app: the routes (`handlers.Handlers`), the gateway middleware (limits,
API key, body), OpenAI error JSON for every failure, and a lifespan that runs the
stats logger. Admission control (in sequences) happens in the serving classes,
once a request has been read and validated."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from asyncllm.chat_template import ChatTemplate, resolve_template_source
from asyncllm.errors import EngineDeadError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.server.config import ServerConfig
from asyncllm.server.gateway import GatewayMiddleware, error_response, route_path
from asyncllm.server.handlers import Handlers
from asyncllm.server.limits import Admission
from asyncllm.server.lora import LoRAHandlers
from asyncllm.server.metrics import ServerMetrics, StatsLogger
from asyncllm.server.protocol import APIError
from asyncllm.server.response_store import ResponseStore
from asyncllm.server.serving_chat import ChatServing
from asyncllm.server.serving_completions import CompletionServing
from asyncllm.server.serving_embeddings import EmbeddingServing
from asyncllm.server.serving_messages import MessagesServing
from asyncllm.server.serving_responses import ResponsesServing
from asyncllm.server.token_text import TokenText
from asyncllm.server.ui_routes import ui_routes

logger = logging.getLogger(__name__)


def build_app(engine: AsyncLLM, config: ServerConfig) -> Starlette:
    """The server's app around a started engine. The caller owns the engine (and
    shuts it down after the app has stopped)."""
    source = resolve_template_source(
        config.chat_template,
        engine.tokenizer.config,
        (engine.tokenizer.directory, engine.args.model),
    )
    tok = engine.tokenizer
    template = ChatTemplate(source, tok.bos_token, tok.eos_token) if source else None
    metrics = ServerMetrics(config.served_model_names[0])
    admission = Admission(config.max_concurrent_requests)
    token_text = TokenText(tok)
    completions = CompletionServing(engine, config, metrics, admission, token_text)
    chat = ChatServing(engine, config, metrics, template, admission, token_text)
    store = None
    if config.enable_store:
        store = ResponseStore(config.max_stored_responses, config.max_response_store_bytes)
    responses = ResponsesServing(chat, store)
    messages = MessagesServing(chat)
    chat.adapters = completions.adapters  # one set of served adapters
    loras = LoRAHandlers(engine, completions.adapters)
    embeddings = EmbeddingServing(engine, config, metrics, admission, token_text)
    embeddings.adapters = completions.adapters  # an adapter's name there is a 400, not a 404
    h = Handlers(engine, config, metrics, completions, chat, responses, messages, embeddings)
    stats_logger = StatsLogger(metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        for name, path in config.lora_modules:  # a bad adapter stops the start, named
            await loras.add(name, path)
        task = asyncio.ensure_future(_log_stats(stats_logger, h.core_stats, config.stats_interval))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    routes = _routes(engine, config, h, loras)
    app = Starlette(
        routes=routes,
        exception_handlers={
            APIError: _on_api_error,
            HTTPException: _on_http_error,
            EngineDeadError: _on_engine_dead,
            Exception: _on_error,
        },
        lifespan=lifespan,
    )
    app.add_middleware(GatewayMiddleware, config=config)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.admission = admission
    app.state.handlers = h
    app.state.servings = (completions, chat, embeddings)
    return app


def _routes(
    engine: AsyncLLM, config: ServerConfig, h: Handlers, loras: LoRAHandlers
) -> list[Route]:
    """The endpoints this server answers: the APIs, then what flags add."""
    routes = [
        Route("/v1/completions", h.create_completion, methods=["POST"]),
        Route("/v1/chat/completions", h.create_chat_completion, methods=["POST"]),
        Route("/v1/responses", h.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", h.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", h.delete_response, methods=["DELETE"]),
        Route("/v1/messages", h.create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", h.count_message_tokens, methods=["POST"]),
        Route("/v1/embeddings", h.create_embedding, methods=["POST"]),
        Route("/v1/models", h.list_models, methods=["GET"]),
        Route("/health", h.health, methods=["GET"]),
        Route("/metrics", h.get_metrics, methods=["GET"]),
        Route("/tokenize", h.tokenize, methods=["POST"]),
        Route("/detokenize", h.detokenize, methods=["POST"]),
        Route("/reset_prefix_cache", h.reset_prefix_cache, methods=["POST"]),
        Route("/version", h.version, methods=["GET"]),
    ]
    if engine.args.profile_dir:  # torch profiling of the core: only when asked for
        routes += [
            Route("/start_profile", h.start_profile, methods=["POST"]),
            Route("/stop_profile", h.stop_profile, methods=["POST"]),
        ]
    if config.allow_runtime_lora_updating:  # behind the API key, like the rest
        routes += lora_routes(loras)
    if config.ui:  # the browser page (chat, completions, dashboard); --no-ui leaves it out
        routes += ui_routes()
    return routes


def lora_routes(loras: LoRAHandlers) -> list[Route]:
    """The run-time adapter endpoints, served only with --allow-runtime-lora-updating."""
    return [
        Route("/v1/load_lora_adapter", loras.load, methods=["POST"]),
        Route("/v1/unload_lora_adapter", loras.unload, methods=["POST"]),
    ]


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, APIError)
    return error_response(exc, route_path(request.scope))


async def _on_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(APIError(exc.status_code, str(exc.detail)), route_path(request.scope))


async def _on_engine_dead(request: Request, exc: Exception) -> Response:
    error = APIError(503, "the engine is not running", code="engine_dead")
    return error_response(error, route_path(request.scope))


async def _on_error(request: Request, exc: Exception) -> Response:
    logger.exception("request %s %s failed", request.method, route_path(request.scope))
    error = APIError(500, "internal server error", code="internal_error")
    return error_response(error, route_path(request.scope))


async def abort_in_flight(app: Starlette) -> None:
    """Abort every running request (shutdown, once its grace period is over);
    their streams end with finish_reason "abort"."""
    for serving in app.state.servings:
        await serving.abort_all()


async def _log_stats(stats_logger: StatsLogger, core_stats: Any, interval: float) -> None:
    if interval <= 0:
        return
    while True:
        await asyncio.sleep(interval)
        stats_logger.log(await core_stats())
