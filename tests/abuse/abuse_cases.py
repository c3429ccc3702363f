"""The catalogue of bad inputs the abuse tests send and benches/bench_abuse.py
times: every client-controlled size of issue 10 section 3 just past its limit,
plus malformed JSON, wrong types, invalid UTF-8, token ids out of range, empty
prompts and messages, an unknown model and wrong routes, each with the status and
the `param` the server must answer with.

The server runs with small limits (`LIMITS`, passed as flags by `limit_flags`) so
that a request over a limit is a few kilobytes and answered at once.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

from abuse_http import HOST, Reply, iter_body, read_head, request_head, sse_payloads

# asyncllm-tiny's vocabulary and context
VOCAB = 8192
MAX_MODEL_LEN = 512

LIMITS: dict[str, int] = {
    "max_request_body_bytes": 64 * 1024,
    "max_prompt_chars": 4000,
    "max_prompt_tokens": 300,
    "max_prompts_per_request": 4,
    "max_n": 4,
    "max_stop_strings": 4,
    "max_stop_string_chars": 32,
    "max_logit_bias": 8,
    "max_stop_token_ids": 8,
    "max_chat_messages": 8,
    "max_header_bytes": 8192,
    "max_response_bytes": 256 * 1024,
    "max_concurrent_requests": 8,
}

HEALTHY_PROMPT = "def add(a, b):"
SERVED_MODEL = "asyncllm-tiny"  # the name a server started without a model serves
HEALTHY_MAX_TOKENS = 150


def limit_flags(limits: dict[str, Any]) -> list[str]:
    """`asyncllm serve` flags for `limits` (`max_n` -> `--max-n 4`)."""
    out = []
    for name, value in limits.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return out


def healthy_body(stream: bool = True) -> dict[str, Any]:
    """The well-behaved request: greedy, so its text is the same every time."""
    return {
        "prompt": HEALTHY_PROMPT,
        "max_tokens": HEALTHY_MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


@dataclass(frozen=True)
class Case:
    """One bad request and what the server must answer."""

    name: str
    path: str
    body: bytes
    status: int
    param: str | None
    limit: int | None = None  # a number the message must state (the limit broken)
    headers: tuple[tuple[str, str], ...] = ()
    send_body: bool = True  # False: announce Content-Length, never send the body
    method: str = "POST"


def _j(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def _cmpl(**fields: Any) -> bytes:
    return _j({"prompt": "x", "max_tokens": 2, **fields})


def _chat(**fields: Any) -> bytes:
    return _j({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})


C, CHAT, TOK, DETOK = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"


def limit_cases(lim: dict[str, int]) -> list[Case]:
    """Each client-controlled size one past its limit."""
    chars, tokens = lim["max_prompt_chars"], lim["max_prompt_tokens"]
    msg = {"role": "user", "content": "hi"}
    many_msgs = [msg] * (lim["max_chat_messages"] + 1)
    body_limit = lim["max_request_body_bytes"]
    # " a" is one token of asyncllm-tiny: more tokens than allowed in fewer chars
    token_heavy = " a" * (tokens + 10)
    assert len(token_heavy) < chars
    return [
        Case("body bytes (announced, never sent)", C, b"", 413, None, body_limit,
             (("Content-Length", str(body_limit + 1)),), send_body=False),
        Case("body bytes (sent)", C, _cmpl(prompt="x" * body_limit), 413, None, body_limit),
        Case("prompt chars", C, _cmpl(prompt="x" * (chars + 1)), 400, "prompt", chars),
        Case("prompt chars in a list", C, _cmpl(prompt=["ok", "x" * (chars + 1)]), 400,
             "prompt", chars),
        Case("prompt tokens (ids)", C, _cmpl(prompt=[5] * (tokens + 1)), 413, "prompt", tokens),
        Case("prompt tokens (text)", C, _cmpl(prompt=token_heavy), 413, "prompt", tokens),
        Case("prompts per request", C, _cmpl(prompt=["x"] * (lim["max_prompts_per_request"] + 1)),
             400, "prompt", lim["max_prompts_per_request"]),
        Case("id prompts per request", C,
             _cmpl(prompt=[[5]] * (lim["max_prompts_per_request"] + 1)), 400, "prompt",
             lim["max_prompts_per_request"]),
        Case("n", C, _cmpl(n=lim["max_n"] + 1), 400, "n", lim["max_n"]),
        Case("n (chat)", CHAT, _chat(n=lim["max_n"] + 1), 400, "n", lim["max_n"]),
        Case("stop strings", C, _cmpl(stop=[f"s{i}" for i in range(lim["max_stop_strings"] + 1)]),
             400, "stop", lim["max_stop_strings"]),
        Case("stop string chars", C, _cmpl(stop="y" * (lim["max_stop_string_chars"] + 1)), 400,
             "stop", lim["max_stop_string_chars"]),
        Case("logit_bias entries", C,
             _cmpl(logit_bias={str(i): 1 for i in range(lim["max_logit_bias"] + 1)}), 400,
             "logit_bias", lim["max_logit_bias"]),
        Case("stop_token_ids entries", C,
             _cmpl(stop_token_ids=list(range(3, lim["max_stop_token_ids"] + 4))), 400,
             "stop_token_ids", lim["max_stop_token_ids"]),
        Case("chat messages", CHAT, _chat(messages=many_msgs), 400, "messages",
             lim["max_chat_messages"]),
        Case("chat chars", CHAT, _chat(messages=[{"role": "user", "content": "x" * (chars + 1)}]),
             400, "messages", chars),
        Case("tokenize chars", TOK, _j({"prompt": "x" * (chars + 1)}), 400, "prompt", chars),
        Case("tokenize messages", TOK, _j({"messages": many_msgs}), 400, "messages",
             lim["max_chat_messages"]),
        Case("header bytes", C, _cmpl(), 431, None, None,
             (("X-Filler", "h" * (lim["max_header_bytes"] + 1)),)),
        Case("response bytes (completions)", C,
             _cmpl(prompt=HEALTHY_PROMPT, n=lim["max_n"], echo=True, logprobs=20, max_tokens=400),
             400, "max_tokens", lim["max_response_bytes"]),
        Case("response bytes (chat)", CHAT,
             _chat(n=lim["max_n"], logprobs=True, top_logprobs=20, max_tokens=400), 400,
             "max_tokens", lim["max_response_bytes"]),
        Case("sequences over the concurrency limit", C,
             _cmpl(prompt=["x"] * lim["max_prompts_per_request"], n=lim["max_n"]), 400, "n",
             lim["max_concurrent_requests"]),
    ]  # fmt: skip


def malformed_cases() -> list[Case]:
    """Requests that are wrong whatever the limits."""
    big = 2**64 - 1
    return [
        Case("malformed JSON", C, b'{"prompt": "x",', 400, None),
        Case("empty body", C, b"", 400, None),
        Case("body is an array", C, b"[1, 2]", 400, None),
        Case("body is null", CHAT, b"null", 400, None),
        Case("deeply nested JSON", C, b'{"prompt": ' + b"[" * 10_000 + b"]" * 10_000 + b"}",
             400, None),
        Case("invalid UTF-8", C, b'{"prompt": "\xff\xfe", "max_tokens": 2}', 400, None),
        Case("lone surrogate escape", CHAT,
             b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 2}', 400,
             None),
        Case("n wrong type", C, _cmpl(n="many"), 400, "n"),
        Case("temperature wrong type", C, _cmpl(temperature="hot"), 400, "temperature"),
        Case("max_tokens fractional", C, _cmpl(max_tokens=1.5), 400, "max_tokens"),
        Case("max_tokens huge", C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 400 + b"}", 400,
             "max_tokens"),
        Case("prompt wrong type", C, _j({"prompt": 5}), 400, "prompt"),
        Case("prompt missing", C, _j({"max_tokens": 2}), 400, "prompt"),
        Case("messages wrong type", CHAT, _j({"messages": "hi"}), 400, "messages"),
        Case("message without role", CHAT, _j({"messages": [{"content": "hi"}]}), 400, "messages"),
        Case("stop wrong type", C, _cmpl(stop=5), 400, "stop"),
        Case("stream wrong type", C, _cmpl(stream=[1]), 400, "stream"),
        Case("negative temperature", C, _cmpl(temperature=-1), 400, "temperature"),
        Case("negative temperature, streamed", C, _cmpl(temperature=-1, stream=True), 400,
             "temperature"),
        Case("max_tokens past the context", C, _cmpl(max_tokens=MAX_MODEL_LEN + 1), 400,
             "max_tokens"),
        Case("prompt token id = vocab", C, _cmpl(prompt=[VOCAB]), 400, "prompt", VOCAB),
        Case("prompt token id negative", C, _cmpl(prompt=[1, -1]), 400, "prompt"),
        Case("prompt token id past int64", C, _cmpl(prompt=[[1], [2**70]]), 400, "prompt"),
        Case("stop_token_ids out of range", C, _cmpl(stop_token_ids=[VOCAB]), 400,
             "stop_token_ids", VOCAB),
        Case("stop_token_ids out of range, streamed", C,
             _cmpl(stop_token_ids=[VOCAB], stream=True), 400, "stop_token_ids", VOCAB),
        Case("detokenize id out of range", DETOK, _j({"tokens": [-5]}), 400, "tokens"),
        Case("seed 2**64-1 with n=2", C, _cmpl(seed=big, n=2), 400, "seed"),
        Case("seed 2**64-1 with n=2, streamed", C, _cmpl(seed=big, n=2, stream=True), 400, "seed"),
        Case("seed 2**64-1 with n=2 (chat)", CHAT, _chat(seed=big, n=2), 400, "seed"),
        Case("empty prompt list", C, _cmpl(prompt=[]), 400, "prompt"),
        Case("empty token-id prompt", C, _cmpl(prompt=[[]]), 400, "prompt"),
        Case("empty messages", CHAT, _chat(messages=[]), 400, "messages"),
        Case("tokenize nothing", TOK, _j({}), 400, "prompt"),
        Case("unknown model", C, _cmpl(model="no-such-model"), 404, "model"),
        Case("unknown model (chat)", CHAT, _chat(model="no-such-model"), 404, "model"),
        Case("unknown model, streamed", C, _cmpl(model="no-such-model", stream=True), 404,
             "model"),
        Case("unknown model (tokenize)", TOK, _j({"model": "no-such-model", "prompt": "x"}), 404,
             "model"),
        Case("wrong method", C, b"", 405, None, method="GET"),
        Case("unknown route", "/v1/nothing-here", _j({}), 404, None),
    ]  # fmt: skip


def all_cases(limits: dict[str, int]) -> list[Case]:
    return limit_cases(limits) + malformed_cases()


# the longest error message a client gets back: a bad request of megabytes must not
# come back echoed
MAX_MESSAGE_CHARS = 1000


def _exchange(port: int, head: bytes, body: bytes, timeout: float) -> tuple[bytes, float]:
    """One request on a blocking socket: the body sent from a second thread while
    the answer is read, everything the server sent until it closed, and the time
    to its first byte. A server that answers early (413 from the headers) and
    closes is heard even when the rest of the body then meets a reset, which
    would make an asyncio stream drop the answer it already holds."""
    sock = socket.create_connection((HOST, port), timeout=timeout)
    start = time.perf_counter()

    def pump() -> None:
        try:
            sock.sendall(head)
            view = memoryview(body)
            for i in range(0, len(body), 1 << 16):
                sock.sendall(view[i : i + (1 << 16)])
        except OSError:
            pass  # the server answered and closed before taking it all

    sender = threading.Thread(target=pump, daemon=True)
    sender.start()
    got = bytearray()
    first = 0.0
    try:
        while data := sock.recv(1 << 20):
            first = first or time.perf_counter() - start
            got += data
    except ConnectionResetError:
        pass  # after the answer, when the server closed on unread body bytes
    finally:
        sock.close()
        sender.join(timeout)
    return bytes(got), first


async def send_case(port: int, case: Case, timeout: float = 30.0) -> Reply:
    """Sends one case as a client would (a body announced but never sent stays
    unsent: the server must answer from the headers alone)."""
    headers = dict(case.headers)
    length = len(case.body) if case.send_body and "Content-Length" not in headers else None
    head = request_head(case.method, case.path, length, headers)
    body = case.body if case.send_body else b""
    try:
        raw, first = await asyncio.to_thread(_exchange, port, head, body, timeout)
    except TimeoutError:
        return Reply(0, {}, f"no answer within {timeout} s".encode(), timeout)
    except OSError as exc:
        return Reply(0, {}, f"connection failed: {exc!r}".encode())
    if not raw:
        return Reply(0, {}, b"closed without an answer", first)
    reader = asyncio.StreamReader()
    reader.feed_data(raw)
    reader.feed_eof()
    try:
        status, resp_headers = await read_head(reader)
        whole = b"".join([piece async for piece in iter_body(reader, resp_headers)])
    except (ValueError, asyncio.IncompleteReadError) as exc:
        return Reply(0, {}, f"not an HTTP response ({exc!r}): {raw[:200]!r}".encode(), first)
    events = []
    if resp_headers.get("content-type", "").startswith("text/event-stream"):
        events = sse_payloads(bytearray(whole))
    return Reply(status, resp_headers, whole, first, events)


def problems(case: Case, reply: Reply) -> list[str]:
    """What is wrong with the server's answer to `case` (empty: all right)."""
    out = []
    if reply.status != case.status:
        out.append(f"status {reply.status}, want {case.status}: {reply.body[:300]!r}")
        return out
    try:
        error = reply.error()
    except (ValueError, AssertionError):
        return [f"not an OpenAI error body: {reply.body[:300]!r}"]
    if set(error) != {"message", "type", "param", "code"}:
        out.append(f"error keys {sorted(error)}")
    if error.get("param") != case.param:
        out.append(f"param {error.get('param')!r}, want {case.param!r}: {error}")
    message = error.get("message")
    if not isinstance(message, str) or not message:
        out.append(f"message {message!r}")
    elif len(message) > MAX_MESSAGE_CHARS:
        out.append(f"message of {len(message)} characters (echoes the input?)")
    elif case.limit is not None and str(case.limit) not in message:
        out.append(f"message does not state the limit {case.limit}: {message!r}")
    elif "SamplingParams" in message:
        out.append(f"message names an internal class: {message!r}")
    return out


@dataclass
class StreamRun:
    """A healthy stream as its client saw it: the text and when each token came."""

    text: str
    arrivals: list[float]  # perf_counter() of each chunk that carried text
    finish_reason: str | None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


async def healthy_stream(port: int, max_tokens: int = HEALTHY_MAX_TOKENS) -> StreamRun:
    """The healthy request, streamed through the official openai client."""
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"http://{HOST}:{port}/v1", api_key="none", max_retries=0, timeout=120
    )
    try:
        body = healthy_body()
        stream = await client.completions.create(
            model=SERVED_MODEL,
            prompt=body["prompt"],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        parts, arrivals, finish = [], [], None
        async for chunk in stream:
            choice = chunk.choices[0]
            if choice.text:
                arrivals.append(time.perf_counter())
                parts.append(choice.text)
            finish = choice.finish_reason or finish
        return StreamRun("".join(parts), arrivals, finish)
    finally:
        await client.close()
