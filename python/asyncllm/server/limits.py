"""The per-request limits of `ServerConfig`, checked on a parsed request before
any work is done for it, and admission control in sequences.

Every error names the request's field, the limit and the flag that sets it, and
never echoes the input (a client that sent megabytes gets a few bytes back).
"""

from __future__ import annotations

from typing import Any

from asyncllm.server.config import ServerConfig
from asyncllm.server.protocol import APIError, bad_request

_RETRY_AFTER_S = "1"

# Estimated bytes per token of a response, by shape; measured on real responses
# (a logprob entry with its token string and JSON punctuation) and rounded up.
_TEXT_BYTES = 8
_LEGACY_LP_BYTES = 32  # tokens, token_logprobs, text_offset entries
_LEGACY_TOP_BYTES = 30  # one top_logprobs entry
_CHAT_LP_BYTES = 100  # token, logprob, bytes
_CHAT_TOP_BYTES = 80  # one top_logprobs entry with its bytes
_SSE_CHUNK_BYTES = 160  # a streamed chunk's head (id, object, created, model, index)
_CHOICE_BYTES = 256


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def over_limit(param: str, what: str, value: int, limit_name: str, limit: int) -> APIError:
    """A 400 for a field over a limit: `param` has `value` `what`, at most `limit`."""
    return bad_request(
        f"{param} has {value} {what}; this server accepts at most {limit} ({_flag(limit_name)})",
        param,
    )


class RequestLimits:
    """Checks one parsed request against the configured limits."""

    def __init__(self, config: ServerConfig, max_model_len: int) -> None:
        self.config = config
        self.max_prompt_tokens = min(config.max_prompt_tokens or max_model_len, max_model_len)

    def check_sampling(self, req: Any) -> None:
        """The fields both endpoints share: n, stop, stop_token_ids, logit_bias."""
        c = self.config
        if isinstance(req.n, int) and req.n > c.max_n:
            raise over_limit("n", "choices", req.n, "max_n", c.max_n)
        self.check_stop(req.stop, "stop")
        ids = req.stop_token_ids or []
        if len(ids) > c.max_stop_token_ids:
            raise over_limit(
                "stop_token_ids", "entries", len(ids), "max_stop_token_ids", c.max_stop_token_ids
            )
        bias = req.logit_bias or {}
        if len(bias) > c.max_logit_bias:
            raise over_limit("logit_bias", "entries", len(bias), "max_logit_bias", c.max_logit_bias)

    def check_stop(self, stop: str | list[str] | None, param: str) -> None:
        """Stop strings: how many, and the longest."""
        c = self.config
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if len(stop) > c.max_stop_strings:
            raise over_limit(param, "strings", len(stop), "max_stop_strings", c.max_stop_strings)
        longest = max((len(s) for s in stop), default=0)
        if longest > c.max_stop_string_chars:
            raise over_limit(
                param,
                "characters in one string",
                longest,
                "max_stop_string_chars",
                c.max_stop_string_chars,
            )

    def check_prompts(self, prompts: list[Any]) -> None:
        """A completions prompt list: count, characters of text prompts, length of
        token-id prompts (a text prompt's tokens are checked once tokenized)."""
        c = self.config
        if len(prompts) > c.max_prompts_per_request:
            raise over_limit(
                "prompt",
                "prompts",
                len(prompts),
                "max_prompts_per_request",
                c.max_prompts_per_request,
            )
        for item in prompts:
            if isinstance(item, str):
                self.check_chars(len(item), "prompt")
            else:
                self.check_tokens(len(item), "prompt")

    def check_chars(self, num_chars: int, param: str) -> None:
        if num_chars > self.config.max_prompt_chars:
            raise over_limit(
                param, "characters", num_chars, "max_prompt_chars", self.config.max_prompt_chars
            )

    def check_tokens(self, num_tokens: int, param: str) -> None:
        limit = self.max_prompt_tokens
        if num_tokens > limit:
            flag = "max_prompt_tokens" if self.config.max_prompt_tokens else "max_model_len"
            raise APIError(
                413,
                f"{param} has {num_tokens} tokens; this server accepts at most {limit} "
                f"({_flag(flag)})",
                param=param,
                code="context_length_exceeded",
            )

    def check_messages(self, messages: list[Any], param: str = "messages") -> None:
        c = self.config
        if len(messages) > c.max_chat_messages:
            raise over_limit(
                param, "messages", len(messages), "max_chat_messages", c.max_chat_messages
            )
        chars = 0
        for m in messages:
            content = m.content
            if isinstance(content, str):
                chars += len(content)
            elif isinstance(content, list):
                for part in content:
                    text = part.get("text") if isinstance(part, dict) else None
                    chars += len(text) if isinstance(text, str) else 0
        self.check_chars(chars, param)

    def check_response_size(
        self,
        prompt_lens: list[int],
        max_tokens: list[int],
        n: int,
        *,
        echo: bool,
        logprobs: int | None,
        chat: bool,
        stream: bool,
    ) -> None:
        """Rejects a request whose response could exceed --max-response-bytes,
        from an estimate made before it runs."""
        per_token = _TEXT_BYTES
        if logprobs is not None:
            if chat:
                per_token += _CHAT_LP_BYTES + _CHAT_TOP_BYTES * logprobs
            else:
                per_token += _LEGACY_LP_BYTES + _LEGACY_TOP_BYTES * (logprobs + 1)
        if stream:
            per_token += _SSE_CHUNK_BYTES
        total = 0
        for prompt_len, out_len in zip(prompt_lens, max_tokens, strict=True):
            tokens = out_len + (prompt_len if echo else 0)
            total += n * (_CHOICE_BYTES + tokens * per_token)
        limit = self.config.max_response_bytes
        if total > limit:
            raise bad_request(
                f"this request could build a response of about {total} bytes (n={n}, "
                f"{len(prompt_lens)} prompt(s), max_tokens, echo and logprobs); this server "
                f"builds at most {limit} ({_flag('max_response_bytes')}): lower n, max_tokens "
                "or logprobs, or split the request",
                "max_tokens",
            )


class Admission:
    """Admits at most `limit` sequences (prompts x n) at once; beyond that a 429
    with Retry-After rather than an unbounded queue. A request is admitted after
    it has been read and validated, so a client that is slow to send its body
    holds no slot; it holds its slots until its response has been sent or its
    client has gone (the stream-idle timeout bounds a client that stops reading)."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.num_in_flight = 0

    def admit(self, num_seqs: int, param: str = "n") -> Ticket:
        """`param`: the field a request over the whole limit is told to lower."""
        limit = self.limit
        if limit is not None:
            if num_seqs > limit:
                raise bad_request(
                    f"this request runs {num_seqs} sequences (prompts x n); this server runs "
                    f"at most {limit} at once (--max-concurrent-requests)",
                    param,
                )
            if self.num_in_flight + num_seqs > limit:
                raise APIError(
                    429,
                    f"the server is at its limit of {limit} concurrent sequences; retry later",
                    code="too_many_requests",
                    headers={"Retry-After": _RETRY_AFTER_S},
                )
        self.num_in_flight += num_seqs
        return Ticket(self, num_seqs)


class Ticket:
    """The slots of one admitted request; `release` is idempotent."""

    __slots__ = ("admission", "num_seqs")

    def __init__(self, admission: Admission, num_seqs: int) -> None:
        self.admission: Admission | None = admission
        self.num_seqs = num_seqs

    def release(self) -> None:
        if self.admission is not None:
            self.admission.num_in_flight -= self.num_seqs
            self.admission = None
