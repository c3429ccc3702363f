"""The ASGI app: routes, API-key check and admission control (one pure-ASGI
middleware, so streamed responses pass through untouched), OpenAI error JSON for
every failure, and a lifespan that runs the stats logger."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from asyncllm import __version__
from asyncllm.errors import EngineDeadError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.server.chat_template import ChatTemplate, resolve_template_source
from asyncllm.server.metrics import CONTENT_TYPE, ServerMetrics, StatsLogger
from asyncllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    parse_body,
)
from asyncllm.server.serving_base import ServerConfig
from asyncllm.server.serving_chat import ChatServing
from asyncllm.server.serving_completions import CompletionServing

logger = logging.getLogger(__name__)

_GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_OPEN_PATHS = frozenset({"/health"})
_HEALTH_TIMEOUT_S = 5.0
_STATS_TIMEOUT_S = 5.0
_RETRY_AFTER_S = "1"


def _json(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json")


def error_response(exc: APIError) -> Response:
    return Response(
        exc.body(), status_code=exc.status, media_type="application/json", headers=exc.headers
    )


class GatewayMiddleware:
    """Checks the API key (every path but /health) and admits at most
    `max_concurrent_requests` generation requests at once; beyond that, 429 with
    Retry-After rather than an unbounded queue. A streamed request counts until
    its stream ends."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_concurrent: int | None) -> None:
        self.app = app
        self.api_key = f"Bearer {api_key}".encode() if api_key else None
        self.max_concurrent = max_concurrent
        self.num_in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.api_key is not None and path not in _OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.api_key):
                error = APIError(401, "Incorrect or missing API key", code="invalid_api_key")
                await error_response(error)(scope, receive, send)
                return
        if path not in _GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.max_concurrent is not None and self.num_in_flight >= self.max_concurrent:
            error = APIError(
                429,
                f"the server is at its limit of {self.max_concurrent} concurrent requests; "
                "retry later",
                code="too_many_requests",
                headers={"Retry-After": _RETRY_AFTER_S},
            )
            await error_response(error)(scope, receive, send)
            return
        self.num_in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.num_in_flight -= 1


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
    model_name = config.served_model_names[0]
    metrics = ServerMetrics(model_name)
    completions = CompletionServing(engine, config, metrics)
    chat = ChatServing(engine, config, metrics, template)
    stats_logger = StatsLogger(metrics)

    async def core_stats() -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(engine.get_stats(), _STATS_TIMEOUT_S)
        except Exception:  # a dead or hung core: metrics without its state
            return None

    async def create_completion(request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        return await completions.create(req, request.receive)

    async def create_chat_completion(request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body())
        return await chat.create(req, request.receive)

    async def list_models(request: Request) -> Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "asyncllm",
                "root": engine.args.model,
                "max_model_len": engine.max_model_len,
            }
            for name in config.served_model_names
        ]
        return _json({"object": "list", "data": data})

    async def health(request: Request) -> Response:
        try:
            await engine.check_health(_HEALTH_TIMEOUT_S)
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def get_metrics(request: Request) -> Response:
        body = metrics.render(await core_stats())
        return Response(body, media_type=CONTENT_TYPE)

    async def tokenize(request: Request) -> Response:
        req = parse_body(TokenizeRequest, await request.body())
        completions.check_model(req.model)
        if req.messages is not None:
            _, ids = chat.render_prompt(req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise bad_request("give 'prompt' or 'messages'", "prompt")
        return _json({"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len})

    async def detokenize(request: Request) -> Response:
        req = parse_body(DetokenizeRequest, await request.body())
        completions.check_model(req.model)
        vocab = engine.input_processor.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside [0, {vocab})", "tokens")
        return _json({"prompt": tok.decode(req.tokens)})

    async def version(request: Request) -> Response:
        return _json({"version": __version__})

    async def on_api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return error_response(exc)

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        return error_response(APIError(exc.status_code, str(exc.detail)))

    async def on_engine_dead(request: Request, exc: Exception) -> Response:
        return error_response(APIError(503, "the engine is not running", code="engine_dead"))

    async def on_error(request: Request, exc: Exception) -> Response:
        logger.exception("request %s %s failed", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", code="internal_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        task = asyncio.ensure_future(_log_stats(stats_logger, core_stats, config.stats_interval))
        try:
            yield
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    routes = [
        Route("/v1/completions", create_completion, methods=["POST"]),
        Route("/v1/chat/completions", create_chat_completion, methods=["POST"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", get_metrics, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes,
        exception_handlers={
            APIError: on_api_error,
            HTTPException: on_http_error,
            EngineDeadError: on_engine_dead,
            Exception: on_error,
        },
        lifespan=lifespan,
    )
    app.add_middleware(
        GatewayMiddleware, api_key=config.api_key, max_concurrent=config.max_concurrent_requests
    )
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.servings = (completions, chat)
    return app


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
