"""Structured output with a reasoning parser: the constraint applies to the
answer after `</think>`, and the reasoning stays free text (vLLM's default; its
`enable_in_reasoning` puts the reasoning under the constraint too).

A real `asyncllm serve` of a tiny random-weight Qwen2 whose tokenizer is
Qwen3's (the qwen2.5 files with Qwen3's four added tokens, `<think>` and
`</think>` among them), `--reasoning-parser deepseek_r1` (the output starts in
reasoning), driven by the openai client. The random model would never close
its reasoning, so a `logit_bias` on `</think>` makes it do so after a few
tokens; what comes after must then match the request's constraint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from asyncllm.errors import ConfigError
from asyncllm.server.config import parse_structured_outputs_config
from server_process import serving
from tiny_models import make_tiny_qwen

openai = pytest.importorskip("openai")

MODEL = "tiny-qwen3"
# Qwen3's added tokens after Qwen2.5's (ids as in Qwen3's tokenizer.json)
QWEN3_ADDED = {151665: "<tool_response>", 151666: "</tool_response>"}
THINK_OPEN, THINK_CLOSE = 151667, 151668
QWEN3_ADDED.update({THINK_OPEN: "<think>", THINK_CLOSE: "</think>"})
SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


def qwen3_tokenizer(model: Path) -> None:
    """Adds Qwen3's four added tokens (not special: the text keeps them)."""
    path = model / "tokenizer.json"
    tok = json.loads(path.read_text())
    for id_, content in QWEN3_ADDED.items():
        tok["added_tokens"].append(
            {
                "id": id_,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    path.write_text(json.dumps(tok))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_qwen(tmp_path_factory.mktemp("qwen3-reasoning"), vocab_size=THINK_CLOSE + 1)
    qwen3_tokenizer(model)
    log_dir = tmp_path_factory.mktemp("reasoning-server")
    with serving(log_dir, model, MODEL, "--reasoning-parser", "deepseek_r1") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client: Any, **kw: Any) -> Any:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Is it? Think first."}],
        "max_tokens": 40,
        "temperature": 1.0,
        "seed": 11,
        # closes the reasoning after a few tokens of the random model's own
        "logit_bias": {str(THINK_CLOSE): 11.0},
    }
    return client.chat.completions.create(**{**body, **kw})


def test_choice_applies_to_the_answer_not_the_reasoning(client):
    """Every choice that ends answers one of the choices after its reasoning,
    and the reasoning is the model's own text, not a choice."""
    r = chat(client, n=8, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    ended = [c for c in r.choices if c.finish_reason == "stop"]
    assert ended, [c.message for c in r.choices]
    for c in ended:
        assert c.message.content in ("yes", "no"), c.message
    thoughts = [c.message.model_extra["reasoning_content"] for c in ended]
    assert any(t and t not in ("yes", "no") for t in thoughts), thoughts
    for c in r.choices:  # cut while reasoning: no answer yet, never a broken one
        if c.finish_reason == "length":
            assert not c.message.content, c.message


def test_json_schema_answer_streamed_and_not(client):
    """response_format json_schema: the answer parses and matches; streamed,
    the reasoning and content deltas add up to the same reply."""
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    whole = chat(client, response_format=fmt)
    (c,) = whole.choices
    assert c.finish_reason == "stop", c.message
    assert json.loads(c.message.content)["answer"] in ("yes", "no")
    reasoning, content = "", ""
    for chunk in chat(client, response_format=fmt, stream=True):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    whole_reasoning = c.message.model_extra["reasoning_content"]  # None when empty
    assert (reasoning or None, content) == (whole_reasoning, c.message.content)


def test_named_tool_call_after_reasoning(client):
    """A named tool_choice constrains the call, not the thinking before it."""
    tool = {
        "type": "function",
        "function": {"name": "decide", "parameters": SCHEMA},
    }
    r = chat(client, tools=[tool], tool_choice={"type": "function", "function": {"name": "decide"}})
    msg = r.choices[0].message
    (call,) = msg.tool_calls
    assert call.function.name == "decide"
    # (constrained from the first token, deepseek_r1 would read it all as reasoning)
    assert json.loads(call.function.arguments)["answer"] in ("yes", "no")


def test_structured_outputs_config_is_checked():
    assert parse_structured_outputs_config(None) is False
    assert parse_structured_outputs_config('{"enable_in_reasoning": true}') is True
    assert parse_structured_outputs_config('{"backend": "guidance"}') is False
    for bad, says in [
        ('{"backend": "xgrammar"}', "backend='xgrammar'"),
        ('{"enable_in_reasoning": 1}', "enable_in_reasoning"),
        ('{"reasoning": true}', "unknown key 'reasoning'"),
        ("[1]", "JSON object"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ConfigError, match=says.replace("[", r"\[")):
            parse_structured_outputs_config(bad)
