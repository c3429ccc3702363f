"""OpenAI request bodies as pydantic models, their mapping to `SamplingParams`,
and `APIError`, which every handler raises to answer with OpenAI's error JSON."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asyncllm.errors import ConfigError
from asyncllm.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    RequestOutputKind,
    SamplingParams,
)
from asyncllm.server.protocol_tools import MAX_TOOLS, ChatTool, ToolChoice
from asyncllm.structured_output import openai_fields

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    431: "RequestHeaderFieldsTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    """An error answered as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> bytes:
        error = {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "APIError"),
            "param": self.param,
            "code": self.code if self.code is not None else self.status,
        }
        return json.dumps({"error": error}).encode()


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param, code="invalid_request_error")


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(BaseModel):
    """The sampling fields both endpoints share (OpenAI's names plus vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # OpenAI's: token id (a JSON object's keys are strings) -> bias in [-100, 100].
    # The length bounds stop pydantic at the first entry over, before the rest.
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # vLLM's: only these tokens may be sampled; words never to generate
    allowed_token_ids: Annotated[list[int], Field(max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[str], Field(max_length=MAX_BAD_WORDS)] | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cache
    # -- output constraints (structured_output/openai_fields.py) --
    response_format: dict[str, Any] | None = None  # OpenAI's: json_object, json_schema
    structured_outputs: dict[str, Any] | None = None  # vLLM's: json, regex, choice, grammar

    def structured(self) -> Any:
        """The request's StructuredOutputsParams, or None; a 400 if malformed."""
        try:
            return openai_fields.from_body(self.response_format, self.structured_outputs)
        except openai_fields.FormatError as exc:
            raise bad_request(str(exc), exc.param) from None

    def token_bias(self) -> dict[int, float] | None:
        """`logit_bias` with token-id keys; a 400 naming it for a key that is not one."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, bias in self.logit_bias.items():
            if not key.isascii() or not key.isdigit() or len(key) > 10:
                raise bad_request(
                    f"logit_bias: key {key[:20]!r} is not a token id (a non-negative integer)",
                    "logit_bias",
                )
            out[int(key)] = bias
        return out

    def check_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options needs stream to be true", "stream_options")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None,
        renames: dict[str, str] | None = None,
    ) -> SamplingParams:
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "stop": self.stop if self.stop != [] else None,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "output_kind": RequestOutputKind.DELTA,
            "cache_salt": self.cache_salt,
            "structured_outputs": self.structured(),
            "logit_bias": self.token_bias(),
            "allowed_token_ids": self.allowed_token_ids,
            "bad_words": self.bad_words,
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return to_sampling_params(kwargs, renames or {})


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self.check_unsupported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of must equal n (no best-of search)", "best_of")
        prompt_logprobs = self.logprobs if self.echo and self.logprobs is not None else None
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs)


# Content parts in one message. A static bound (not a flag) so that pydantic
# counts them as it parses the body and stops at the first one over, before
# 100,000 part dicts are built (the process kept ~100 MB after such a request).
MAX_CONTENT_PARTS = 1024


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_CONTENT_PARTS)] | None = (
        None
    )
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # refused unless the server runs with --trust-request-chat-template
    chat_template: str | None = None
    # Tool calling (protocol_tools; serving_tools reads them).
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, else "none"
    parallel_tool_calls: bool = True

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self.check_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        renames = {"logprobs": "top_logprobs"}
        if self.max_completion_tokens is not None:
            renames["max_tokens"] = "max_completion_tokens"
        return self._sampling_params(max_tokens, logprobs, None, renames)

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(BaseModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # with `messages`: rendered through the chat template as the chat endpoint does
    tools: list[ChatTool] | None = Field(default=None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


M = TypeVar("M", bound=BaseModel)
_FIELD = re.compile(r"SamplingParams\.(\w+)=")


def to_sampling_params(kwargs: dict[str, Any], renames: dict[str, str]) -> SamplingParams:
    """SamplingParams(**kwargs), its ConfigError turned into a 400 naming the field
    as the request spelled it."""
    try:
        return SamplingParams(**kwargs)
    except ConfigError as exc:
        match = _FIELD.search(str(exc))
        name = match.group(1) if match else None
        param = renames.get(name, name) if name else None
        message = str(exc).replace("SamplingParams.", "")
        raise bad_request(message, param) from None


def parse_body(model: type[M], body: bytes) -> M:
    """Validate a JSON body; a 400 names the first offending parameter."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors()
        # a size bound inside a union (a message's content parts) is the error
        # to report, not the other member's "should be a string"
        first = next((e for e in errors if e["type"] == "too_long"), errors[0])
        loc = first["loc"]
        param = str(loc[0]) if loc else None  # the rest names union members, not fields
        kind = first["type"]
        if kind == "json_invalid":
            raise bad_request(f"the request body is not valid JSON: {first['msg']}") from None
        raise bad_request(f"{param or 'body'}: {first['msg']}", param) from None
