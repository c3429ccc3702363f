"""Chat templates are found where transformers finds them — `--chat-template` (a file
or the template itself), then `chat_template.jinja` beside the tokenizer or the model
(what current `save_pretrained` writes), then `tokenizer_config.json`'s
`chat_template` (a string or a named list) — and render as `apply_chat_template`
does; `asyncllm serve` on a `save_pretrained` directory answers chat requests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from asyncllm.chat_template import (
    CHAT_TEMPLATE_FILE,
    ChatTemplate,
    ChatTemplateError,
    check_tools,
    prepare_messages,
    resolve_template_source,
)
from asyncllm.errors import ConfigError
from asyncllm.frontend.tokenizer import Tokenizer
from conftest import tokenizer_dir
from server_process import Server, post
from tiny_models import make_tiny_qwen

transformers = pytest.importorskip("transformers")

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Write a haiku about paging."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Italy? Ünïcödé, 日本語, emoji 🙂"},
    ],
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
INLINE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{{ eos_token }}"


def save_pretrained_tokenizer(out: Path) -> Path:
    """The qwen2.5 tokenizer as current transformers writes it: the template in
    chat_template.jinja, none left in tokenizer_config.json."""
    tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir("qwen2.5")))
    tok.save_pretrained(str(out))
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert (out / CHAT_TEMPLATE_FILE).is_file() and "chat_template" not in config, (
        "this transformers no longer writes chat_template.jinja: the test needs a new fixture"
    )
    return out


def ours(directory: Path, option: str | None = None) -> ChatTemplate:
    tok = Tokenizer(directory)
    source = resolve_template_source(option, tok.config, (directory,))
    assert source is not None
    return ChatTemplate(source, tok.bos_token, tok.eos_token)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_tokenizer(tmp_path_factory.mktemp("qwen2.5-saved"))


@pytest.fixture(scope="module")
def reference(saved: Path) -> Any:
    """transformers' tokenizer loaded back from the saved directory (loading a 151k
    vocabulary takes seconds, so once)."""
    return transformers.AutoTokenizer.from_pretrained(str(saved))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_save_pretrained_directory_renders_as_transformers(
    saved, reference, messages, add_generation_prompt
):
    want = reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours(saved).render(messages, add_generation_prompt) == want


def test_tools_reach_the_template_as_in_transformers(saved, reference):
    messages = CONVERSATIONS[0]
    want = reference.apply_chat_template(
        messages, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    got = ours(saved).render(messages, True, {"tools": TOOLS})
    assert got == want and "get_weather" in got


TOOL_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You call tools."},
    {"role": "user", "content": "Weather in Paris and Zürich?"},
    {
        "role": "assistant",
        "content": "Checking both.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "12 C"}]},
]


def test_tool_calls_and_results_render_as_in_transformers(saved, reference):
    """OpenAI messages (arguments as JSON text, content parts) render as
    transformers renders the same conversation with arguments as objects, the
    form it documents for templates."""
    theirs = json.loads(json.dumps(TOOL_HISTORY))
    for call in theirs[2]["tool_calls"]:
        call["function"]["arguments"] = json.loads(call["function"]["arguments"])
    theirs[4]["content"] = "12 C"
    want = reference.apply_chat_template(
        theirs, tools=TOOLS, tokenize=False, add_generation_prompt=True
    )
    got = ours(saved).render(prepare_messages(TOOL_HISTORY), True, {"tools": TOOLS})
    assert got == want
    assert '{"name": "get_weather", "arguments": {"city": "Zürich"}}' in got
    assert "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n12 C" in got


@pytest.mark.parametrize(
    ("message", "where"),
    [
        ({"role": "tool", "content": "x"}, r"messages\[0\]\.tool_call_id"),
        ({"role": "tool", "tool_call_id": "c"}, r"messages\[0\]\.content"),
        ({"content": "x"}, r"messages\[0\]\.role"),
        ({"role": "user", "content": [{"type": "image_url"}]}, "only text content parts"),
        ({"role": "user", "content": 3}, r"messages\[0\]\.content"),
        (
            {"role": "user", "tool_calls": []},
            r"messages\[0\]\.tool_calls: only assistant messages",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]},
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]},
            r"messages\[0\]\.tool_calls\[0\]\.function\.arguments must be a JSON object",
        ),
        (
            {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
            r"messages\[0\]\.tool_calls\[0\]\.function\.name",
        ),
    ],
)
def test_bad_message_shapes_name_the_field(message, where):
    with pytest.raises(ChatTemplateError, match=where):
        prepare_messages([message])


def test_bad_tools_name_the_entry():
    assert check_tools(TOOLS) == TOOLS
    for tools, where in [
        ({"type": "function"}, "tools must be a list"),
        ([{"name": "f"}], r"tools\[0\] must be"),
        ([{"type": "function", "function": {"name": ""}}], r"tools\[0\]\.function\.name"),
        (
            [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": "x"}}],
            r"tools\[1\]\.function\.parameters",
        ),
    ]:
        with pytest.raises(ChatTemplateError, match=where):
            check_tools(tools)


def test_tokenizer_config_string_is_the_fallback(saved):
    """The shipped asset keeps its template in tokenizer_config.json (the older layout)."""
    asset = tokenizer_dir("qwen2.5")
    assert not (asset / CHAT_TEMPLATE_FILE).exists()
    source = resolve_template_source(None, Tokenizer(asset).config, (asset,))
    assert source == (saved / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")


def test_chat_template_jinja_wins_over_tokenizer_config(saved, tmp_path):
    d = tmp_path / "both"
    shutil.copytree(tokenizer_dir("qwen2.5"), d)  # tokenizer_config.json has a template
    d.chmod(0o755)
    (d / CHAT_TEMPLATE_FILE).write_text(INLINE, encoding="utf-8")
    assert resolve_template_source(None, Tokenizer(d).config, (d,)) == INLINE
    reference = transformers.AutoTokenizer.from_pretrained(str(d))
    messages = CONVERSATIONS[1]
    want = reference.apply_chat_template(messages, tokenize=False)
    assert ours(d).render(messages, False) == want


def test_tokenizer_directory_before_model_directory(saved, tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / CHAT_TEMPLATE_FILE).write_text(INLINE, encoding="utf-8")
    config = Tokenizer(saved).config
    tokenizer_first = resolve_template_source(None, config, (saved, model))
    assert tokenizer_first == (saved / CHAT_TEMPLATE_FILE).read_text(encoding="utf-8")
    # a tokenizer directory without a template file: the model's file, then the config
    bare = tmp_path / "bare"
    bare.mkdir()
    assert resolve_template_source(None, {}, (bare, model)) == INLINE
    assert resolve_template_source(None, {"chat_template": "{{ x }}"}, (bare,)) == "{{ x }}"
    assert resolve_template_source(None, {}, (bare,)) is None


def test_option_as_a_file_and_as_an_inline_string(saved, tmp_path):
    messages = CONVERSATIONS[1]
    want = "".join(f"[{m['role']}] {m['content']}\n" for m in messages) + "<|im_end|>"
    inline = ours(saved, INLINE)
    assert inline.render(messages, False) == want
    file = tmp_path / "template.jinja"
    file.write_text(INLINE, encoding="utf-8")
    assert ours(saved, str(file)).render(messages, False) == want
    # the option beats chat_template.jinja
    assert resolve_template_source(INLINE, {}, (saved,)) == INLINE


def test_option_that_is_neither_names_the_flag(saved, tmp_path):
    with pytest.raises(ConfigError, match="--chat-template"):
        resolve_template_source(str(tmp_path / "missing.jinja"), {}, (saved,))
    bad = tmp_path / "latin1.jinja"
    bad.write_bytes(b"{{ '\xff' }}")
    with pytest.raises(ConfigError, match="--chat-template"):
        resolve_template_source(str(bad), {}, (saved,))


@pytest.mark.parametrize("with_default", [True, False])
def test_named_list_in_tokenizer_config(tmp_path, with_default):
    """A list of {name, template}: "default" as transformers uses it, else the first."""
    tool_use = "TOOLS {% for m in messages %}{{ m['content'] }}{% endfor %}"
    default = "DEFAULT {% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}"
    named = [{"name": "tool_use", "template": tool_use}]
    if with_default:
        named.append({"name": "default", "template": default})
    d = tmp_path / "named"
    d.mkdir()
    shutil.copy(tokenizer_dir("qwen2.5") / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((tokenizer_dir("qwen2.5") / "tokenizer_config.json").read_text())
    config["chat_template"] = named
    (d / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")

    source = resolve_template_source(None, Tokenizer(d).config, (d,))
    assert source == (default if with_default else tool_use)
    messages = CONVERSATIONS[0]
    got = ours(d).render(messages, False)
    if with_default:
        reference = transformers.AutoTokenizer.from_pretrained(str(d))
        assert got == reference.apply_chat_template(messages, tokenize=False)
    else:  # transformers refuses a list without a default; asyncllm takes the first
        assert got == "TOOLS " + messages[0]["content"]


# -- the server on a save_pretrained directory -------------------------------------


@pytest.fixture(scope="module")
def saved_model(saved: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Qwen2 with the files the qwen2.5 tokenizer's
    `save_pretrained` wrote beside it (tied embeddings and hidden 32 keep its 151k
    vocabulary small)."""
    path = make_tiny_qwen(tmp_path_factory.mktemp("qwen2-saved"))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).unlink(missing_ok=True)
    for file in saved.iterdir():
        shutil.copy(file, path / file.name)
    assert (path / CHAT_TEMPLATE_FILE).is_file()
    return path


@pytest.mark.timeout(180)
def test_serve_answers_chat_with_chat_template_jinja(saved_model, reference, tmp_path):
    messages = CONVERSATIONS[1]
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want_ids = reference.encode(text, add_special_tokens=False)

    server = Server(tmp_path / "server.log", str(saved_model), "--served-model-name", "tiny")
    try:
        status, body = post(server.url + "/tokenize", {"messages": messages})
        assert status == 200, body
        assert body["tokens"] == want_ids

        request = {
            "model": "tiny",
            "messages": messages,
            "max_tokens": 5,
            "temperature": 0,
            "ignore_eos": True,
        }
        status, body = post(server.url + "/v1/chat/completions", request)
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(want_ids)
        assert body["usage"]["completion_tokens"] == 5
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(body["choices"][0]["message"]["content"], str)
    finally:
        assert server.stop() == 0, server.log.read_text()[-3000:]
