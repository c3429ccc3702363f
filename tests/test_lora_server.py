"""LoRA over HTTP with the official openai client against a real `asyncllm serve`:
a request's `model` picks the adapter (output equal to transformers + peft),
/v1/models lists adapters with their parent, adapters load and unload at run time
only behind the API key and the flag, and /metrics carries vllm:lora_requests_info."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from lora_adapters import make_adapter, peft_greedy
from tokenizers import Tokenizer

from server_process import Server, get_text
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(180)

API_KEY = "sk-lora-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [1, 306, 4966, 304, 1074, 278]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("lora_server")
    model = make_tiny_model(tmp / "model", arch="llama")
    adapters = {
        name: make_adapter(model, tmp / name, seed=seed, r=r)
        for name, seed, r in (("sql", 1, 8), ("chat", 2, 16), ("late", 3, 4))
    }
    ids = {
        name: peft_greedy(model, path, [PROMPT], MAX_TOKENS)[0] for name, path in adapters.items()
    }
    ids["tiny"] = peft_greedy(model, None, [PROMPT], MAX_TOKENS)[0]
    # the text of peft's tokens: what the server's detokenizer must give
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    head = tok.decode(PROMPT)
    refs = {name: tok.decode(PROMPT + t)[len(head) :] for name, t in ids.items()}
    assert len(set(refs.values())) == len(refs)  # the adapters change the output
    return {"tmp": tmp, "model": model, "adapters": adapters, "refs": refs}


@pytest.fixture(scope="module")
def server(setup: dict):
    a = setup["adapters"]
    srv = Server(
        setup["tmp"] / "server.log",
        str(setup["model"]),
        "--dtype",
        "float32",
        "--served-model-name",
        "tiny",
        "--api-key",
        API_KEY,
        "--enable-lora",
        "--max-loras",
        "2",
        "--max-lora-rank",
        "16",
        "--lora-modules",
        f"sql={a['sql']}",
        f"chat={a['chat']}",
        "--allow-runtime-lora-updating",
        "--chat-template",  # the tiny model has none; chat, responses, messages need one
        "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    )
    yield srv
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server: Server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _complete(client, model: str) -> str:
    out = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        extra_body={"ignore_eos": True},
    )
    return out.choices[0].text


def test_model_field_picks_the_adapter(client, setup: dict) -> None:
    for model in ("sql", "chat", "tiny"):
        assert _complete(client, model) == setup["refs"][model], model


def test_each_endpoint_answers_with_the_adapters_name(client, server: Server) -> None:
    """A response names the adapter it ran under (as vLLM's do), on every endpoint
    that generates; embeddings are the base model's, so an adapter there is a 400."""
    out = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2)
    assert out.model == "sql"
    stream = client.completions.create(model="sql", prompt=PROMPT, max_tokens=2, stream=True)
    assert {c.model for c in stream} == {"sql"}
    chat = [{"role": "user", "content": "hi"}]
    assert client.chat.completions.create(model="chat", messages=chat, max_tokens=2).model == (
        "chat"
    )
    chunks = client.chat.completions.create(model="chat", messages=chat, max_tokens=2, stream=True)
    assert {c.model for c in chunks} == {"chat"}
    assert client.responses.create(model="sql", input="hi", max_output_tokens=2).model == "sql"
    assert client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1).model == "tiny"
    req = urllib.request.Request(
        server.url + "/v1/messages",
        data=json.dumps({"model": "chat", "max_tokens": 2, "messages": chat}).encode(),
        headers={**AUTH, "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as reply:
        assert json.loads(reply.read())["model"] == "chat"
    with pytest.raises(openai.BadRequestError, match="LoRA adapter"):
        client.embeddings.create(model="sql", input="hi")


def test_models_lists_adapters_with_parent(client) -> None:
    models = {m.id: m for m in client.models.list().data}
    assert {"tiny", "sql", "chat"} <= set(models)
    assert models["sql"].model_extra["parent"] == "tiny"


def test_unknown_model_is_404(client) -> None:
    with pytest.raises(openai.NotFoundError):
        _complete(client, "nope")


def test_load_and_unload_at_run_time(client, server: Server, setup: dict) -> None:
    url = server.url + "/v1/load_lora_adapter"
    body = {"lora_name": "late", "lora_path": str(setup["adapters"]["late"])}
    assert post(url, body)[0] == 401  # behind the API key
    status, _ = post(url, {"lora_name": "bad", "lora_path": str(setup["tmp"] / "none")}, AUTH)
    assert status == 400
    assert post(url, body, AUTH)[0] == 200
    assert _complete(client, "late") == setup["refs"]["late"]
    assert _complete(client, "sql") == setup["refs"]["sql"]  # still served beside it
    unload = server.url + "/v1/unload_lora_adapter"
    assert post(unload, {"lora_name": "late"}, AUTH)[0] == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, "late")
    assert post(unload, {"lora_name": "late"}, AUTH)[0] == 404


def test_lora_requests_info_metric(client, server: Server) -> None:
    _complete(client, "sql")
    text = get_text(server.url + "/metrics", AUTH)
    assert 'vllm:lora_requests_info{max_lora="2"' in text


def test_runtime_updates_need_the_flag(setup: dict) -> None:
    srv = Server(
        setup["tmp"] / "server2.log", str(setup["model"]), "--dtype", "float32", "--enable-lora"
    )
    try:
        body = {"lora_name": "late", "lora_path": str(setup["adapters"]["late"])}
        assert post(srv.url + "/v1/load_lora_adapter", body)[0] == 404
    finally:
        assert srv.stop() == 0


def test_lora_modules_need_enable_lora(setup: dict, tmp_path: Path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "asyncllm.cli",
            "serve",
            str(setup["model"]),
            "--lora-modules",
            f"sql={setup['adapters']['sql']}",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "need --enable-lora" in out.stderr


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, str]:
    """POST JSON; (status, body text): the LoRA endpoints answer in plain text."""
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
