"""The route handlers, as methods of one object built around a started engine,
so each can be called (and tested) on its own: `await handlers.list_models(req)`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from asyncllm import __version__
from asyncllm.errors import EngineDeadError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.server.config import ServerConfig
from asyncllm.server.metrics import CONTENT_TYPE, ServerMetrics
from asyncllm.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    parse_body,
)
from asyncllm.server.protocol_embeddings import EmbeddingRequest
from asyncllm.server.protocol_messages import CountTokensRequest, MessagesRequest
from asyncllm.server.protocol_responses import ResponsesRequest
from asyncllm.server.response_store import scope_of
from asyncllm.server.serving_base import off_loop
from asyncllm.server.serving_chat import ChatServing
from asyncllm.server.serving_completions import CompletionServing
from asyncllm.server.serving_embeddings import EmbeddingServing
from asyncllm.server.serving_messages import MessagesServing
from asyncllm.server.serving_responses import ResponsesServing
from asyncllm.server.serving_tools import template_tools

logger = logging.getLogger(__name__)

_HEALTH_TIMEOUT_S = 5.0
_STATS_TIMEOUT_S = 5.0
_UTILITY_TIMEOUT_S = 30.0
_PROFILE_STOP_TIMEOUT_S = 300.0  # writing a long window's trace takes a while


def _scope(request: Request) -> str:
    return scope_of(dict(request.scope["headers"]))


def json_response(data: Any, status: int = 200) -> Response:
    return Response(json.dumps(data), status_code=status, media_type="application/json")


class Handlers:
    def __init__(
        self,
        engine: AsyncLLM,
        config: ServerConfig,
        metrics: ServerMetrics,
        completions: CompletionServing,
        chat: ChatServing,
        responses: ResponsesServing,
        messages: MessagesServing,
        embeddings: EmbeddingServing,
    ) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics
        self.completions = completions
        self.chat = chat
        self.responses = responses
        self.messages = messages
        self.embeddings = embeddings

    async def core_stats(self) -> dict[str, Any] | None:
        try:
            return await asyncio.wait_for(self.engine.get_stats(), _STATS_TIMEOUT_S)
        except Exception:  # a dead or hung core: metrics without its state
            return None

    async def create_completion(self, request: Request) -> Response:
        req = parse_body(CompletionRequest, await request.body())
        return await self.completions.create(req, request.receive)

    async def create_chat_completion(self, request: Request) -> Response:
        req = parse_body(ChatCompletionRequest, await request.body())
        return await self.chat.create(req, request.receive)

    async def create_response(self, request: Request) -> Response:
        req = parse_body(ResponsesRequest, await request.body())
        return await self.responses.create(req, request.receive, _scope(request))

    async def get_response(self, request: Request) -> Response:
        found = self.responses.stored(_scope(request), request.path_params["response_id"])
        return json_response(found)

    async def delete_response(self, request: Request) -> Response:
        done = self.responses.delete(_scope(request), request.path_params["response_id"])
        return json_response(done)

    async def create_message(self, request: Request) -> Response:
        req = parse_body(MessagesRequest, await request.body())
        return await self.messages.create(req, request.receive)

    async def count_message_tokens(self, request: Request) -> Response:
        req = parse_body(CountTokensRequest, await request.body())
        return json_response(await self.messages.count_tokens(req))

    async def create_embedding(self, request: Request) -> Response:
        req = parse_body(EmbeddingRequest, await request.body())
        return await self.embeddings.create(req, request.receive)

    async def list_models(self, request: Request) -> Response:
        """The served names only: the model's local path stays private."""
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "asyncllm",
                "root": name,
                "max_model_len": self.engine.max_model_len,
            }
            for name in self.config.served_model_names
        ]
        data += self.completions.adapters.models(self.engine.max_model_len)
        return json_response({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            await self.engine.check_health(_HEALTH_TIMEOUT_S)
        except EngineDeadError:
            return Response(status_code=503)
        return Response(status_code=200)

    async def get_metrics(self, request: Request) -> Response:
        grammars = self.engine.input_processor.grammars  # the front end's own cache
        self.metrics.frontend_grammar_cache_bytes.set(grammars.num_bytes)
        body = self.metrics.render(await self.core_stats())
        return Response(body, media_type=CONTENT_TYPE)

    async def tokenize(self, request: Request) -> Response:
        req = parse_body(TokenizeRequest, await request.body())
        serving = self.completions
        serving.check_model(req.model)
        if req.messages is not None:
            # the tools and template options as /v1/chat/completions renders them
            tools = template_tools(req.tools) if req.tools else None
            template, extra = self.chat.template_inputs(
                req.chat_template, req.chat_template_kwargs, tools
            )
            _, ids = await self.chat.tokenize_messages(
                req.messages, req.add_generation_prompt, extra, template
            )
        elif req.prompt is not None:
            serving.limits.check_chars(len(req.prompt), "prompt")
            ids = await serving.encode(req.prompt, req.add_special_tokens)
        else:
            raise bad_request("give 'prompt' or 'messages'", "prompt")
        return json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len}
        )

    async def detokenize(self, request: Request) -> Response:
        req = parse_body(DetokenizeRequest, await request.body())
        serving = self.completions
        serving.check_model(req.model)
        serving.limits.check_tokens(len(req.tokens), "tokens")
        serving.check_prompt_ids(req.tokens, "tokens")
        text = await off_loop(self.engine.tokenizer.decode, req.tokens)
        return json_response({"prompt": text})

    async def reset_prefix_cache(self, request: Request) -> Response:
        """Drop every cached prefix block not in use (behind the API key)."""
        if self.engine.errored:
            raise APIError(503, "the engine is not running", code="engine_dead")
        reset = await self.engine.call_utility("reset_prefix_cache", None, _UTILITY_TIMEOUT_S)
        return json_response({"reset": bool(reset)})

    async def start_profile(self, request: Request) -> Response:
        """Start torch's profiler in the engine core (routed only with
        --profile-dir; behind the API key). 409 if a profile is running."""
        await self._profile_call("start_profile", _UTILITY_TIMEOUT_S)
        return json_response({"profiling": True})

    async def stop_profile(self, request: Request) -> Response:
        """Stop the profile and write its trace into --profile-dir; answers the
        trace's path and the steps it covers. 409 if none is running."""
        result = await self._profile_call("stop_profile", _PROFILE_STOP_TIMEOUT_S)
        return json_response({"profiling": False, **result})

    async def _profile_call(self, method: str, timeout: float) -> Any:
        if self.engine.errored:
            raise APIError(503, "the engine is not running", code="engine_dead")
        try:
            return await self.engine.call_utility(method, None, timeout)
        except RuntimeError as exc:  # the core refused: already running, or none
            raise APIError(409, str(exc).removeprefix("engine core utility call: ")) from None

    async def version(self, request: Request) -> Response:
        return json_response({"version": __version__})
