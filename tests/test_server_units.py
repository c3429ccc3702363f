"""Server parts on their own: the route handlers called directly (no HTTP), the
text of single tokens for logprobs (byte fragments), and the config checks."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request

from asyncllm import EngineArgs
from asyncllm.errors import ConfigError
from asyncllm.frontend.async_llm import AsyncLLM
from asyncllm.frontend.tokenizer import Tokenizer
from asyncllm.server.app import build_app
from asyncllm.server.config import ServerConfig
from asyncllm.server.protocol import APIError
from asyncllm.server.token_text import TokenText
from conftest import tokenizer_dir

pytestmark = pytest.mark.timeout(120)


def _request(path: str, body: dict | None = None) -> Request:
    data = json.dumps(body or {}).encode()

    async def receive() -> dict:
        return {"type": "http.request", "body": data, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "headers": [], "query_string": b""}
    return Request(scope, receive)


def test_handlers_are_callable_on_their_own():
    async def run() -> None:
        engine = AsyncLLM(EngineArgs(executor="null"), multiprocess=False)
        try:
            config = ServerConfig(served_model_names=["tiny"], max_prompt_chars=10)
            h = build_app(engine, config).state.handlers
            models = json.loads((await h.list_models(_request("/v1/models"))).body)
            assert [m["root"] for m in models["data"]] == ["tiny"]
            reply = await h.tokenize(_request("/tokenize", {"prompt": "def f():"}))
            ids = json.loads(reply.body)["tokens"]
            assert ids == engine.tokenizer.encode("def f():")
            with pytest.raises(APIError) as too_long:
                await h.tokenize(_request("/tokenize", {"prompt": "x" * 11}))
            assert too_long.value.param == "prompt" and "--max-prompt-chars" in str(too_long.value)
            reset = await h.reset_prefix_cache(_request("/reset_prefix_cache"))
            assert json.loads(reset.body) == {"reset": True}
        finally:
            engine.shutdown()

    asyncio.run(run())


@pytest.mark.parametrize("name", ["qwen2.5", "llama-2", "gpt2"])
def test_token_pieces_join_to_the_text_and_fragments_keep_their_bytes(name):
    tok = Tokenizer(tokenizer_dir(name))
    text = TokenText(tok)
    s = "Hello wörld 🙂 中文 end\n  x"
    ids = tok.encode(s, add_special_tokens=False)
    pieces = text.pieces(ids)
    # sentencepiece's decoder strips the first "▁" space; the pieces keep it
    assert "".join(pieces).removeprefix(" ") == tok.decode(ids, skip_special_tokens=False)
    assert "".join(text.pieces_of_text(ids, s) or ()) == s  # fitted to the prompt
    assert b"".join(text.bytes_of(t) for t in ids).decode().endswith(s.lstrip())
    fragments = [t for t in ids if text.display(t).startswith("bytes:")]
    for t in fragments:  # a piece of a character: escaped, its bytes kept
        raw = text.bytes_of(t)
        assert text.display(t) == "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    if fragments:
        assert "" in pieces  # the fragment's share; the character goes to the last piece


def test_limits_must_be_positive():
    with pytest.raises(ConfigError, match="--max-n"):
        ServerConfig(served_model_names=["m"], max_n=0)
    with pytest.raises(ConfigError, match="--body-timeout"):
        ServerConfig(served_model_names=["m"], body_timeout=-1)


def test_embedding_pooling_is_checked():
    with pytest.raises(ConfigError, match="--embedding-pooling='max' is invalid"):
        ServerConfig(served_model_names=["m"], embedding_pooling="max")


def test_every_limit_is_a_documented_flag():
    import argparse
    import dataclasses

    from asyncllm.cli.args import add_limit_args
    from asyncllm.server.config import LIMIT_HELP

    base = {
        "served_model_names",
        "api_key",
        "max_concurrent_requests",
        "chat_template",
        "trust_request_chat_template",
        "tool_call_parser",
        "reasoning_parser",
        "structured_outputs_in_reasoning",
        "enable_store",
        "embedding_pooling",
        "embedding_normalize",
        "shutdown_timeout",
        "stats_interval",
        "ui",
        "root_path",
        "lora_modules",
        "allow_runtime_lora_updating",
    }
    names = {f.name for f in dataclasses.fields(ServerConfig)} - base
    assert names == set(LIMIT_HELP)
    p = argparse.ArgumentParser()
    add_limit_args(p)
    ns = p.parse_args(["--max-n", "4", "--stream-idle-timeout", "1.5"])
    config = ServerConfig(served_model_names=["m"], **{n: getattr(ns, n) for n in LIMIT_HELP})
    assert config.max_n == 4 and config.stream_idle_timeout == 1.5
    assert config.max_request_body_bytes == 16 << 20  # the defaults come through
