"""`POST /v1/embeddings` end to end: a real `asyncllm serve` (tiny random-weight
Llama, float32, `--embedding-pooling mean`) driven by the official `openai`
client. The vectors equal transformers' final hidden states mean-pooled and
normalized (tolerance 1e-5, as tests/test_embeddings.py), in float and base64
encodings; every client-controlled size is bounded with a 400 naming the field."""

from __future__ import annotations

import base64
import struct

import pytest
import torch

from server_process import Server
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")

MODEL = "tiny-embed"
TOL = dict(atol=1e-5, rtol=1e-5)
MAX_INPUTS = 4
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-embed-server"), seed=0)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("embed-server") / "server.log"
    s = Server(
        log,
        str(model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--embedding-pooling",
        "mean",
        "--max-num-batched-tokens",
        "32",
        "--max-embedding-inputs",
        str(MAX_INPUTS),
        "--max-embedding-tokens",
        str(MAX_TOKENS),
    )
    yield s
    assert s.stop() == 0, log.read_text()[-3000:]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def f32(x: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def want(hf_model, ids: list[int], dimensions: int | None = None) -> torch.Tensor:
    """transformers' hidden states, mean-pooled, truncated, normalized."""
    with torch.inference_mode():
        hidden = hf_model.model(torch.tensor([ids])).last_hidden_state[0].mean(0)
    if dimensions is not None:
        hidden = hidden[:dimensions]
    return hidden / hidden.norm()


def test_texts_in_float_and_base64(client, hf_model, tokenizer):
    texts = ["def add(a, b):", "return a + b  # the sum of two numbers, longer than a chunk"]
    ids = [tokenizer(t)["input_ids"] for t in texts]
    floats = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    assert floats.model == MODEL and [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(map(len, ids))
    for d, i in zip(floats.data, ids, strict=True):
        assert isinstance(d.embedding, list)
        torch.testing.assert_close(torch.tensor(d.embedding), want(hf_model, i), **TOL)
    # base64 carries the same values as float32 (float gives them unrounded); left
    # to itself the client asks for base64 and decodes it
    as_f32 = [[f32(v) for v in f.embedding] for f in floats.data]
    decoded = client.embeddings.create(model=MODEL, input=texts)
    assert [list(map(float, d.embedding)) for d in decoded.data] == as_f32
    b64 = client.embeddings.create(model=MODEL, input=texts, encoding_format="base64")
    for d, want_f32 in zip(b64.data, as_f32, strict=True):
        assert isinstance(d.embedding, str)
        raw = base64.b64decode(d.embedding)
        assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == want_f32


def test_token_id_inputs_and_dimensions(client, hf_model):
    one = [1, 450, 4996, 17354, 1701]
    many = [[1, 822, 788], [1, 29871, 13, 1678, 736, 263, 718, 289]]
    r = client.embeddings.create(model=MODEL, input=one, encoding_format="float")
    torch.testing.assert_close(torch.tensor(r.data[0].embedding), want(hf_model, one), **TOL)
    r = client.embeddings.create(model=MODEL, input=many, dimensions=8, encoding_format="float")
    assert r.usage.prompt_tokens == 11
    for d, ids in zip(r.data, many, strict=True):
        assert len(d.embedding) == 8
        torch.testing.assert_close(torch.tensor(d.embedding), want(hf_model, ids, 8), **TOL)


def test_bad_requests_name_the_field(client):
    def refused(match: str, **kwargs) -> str | None:
        with pytest.raises(openai.BadRequestError, match=match) as info:
            client.embeddings.create(model=MODEL, encoding_format="float", **kwargs)
        return info.value.body.get("param")  # type: ignore[union-attr]

    assert refused("dimensions=65 is invalid", input="hi", dimensions=65) == "dimensions"
    assert refused("dimensions=0 is invalid", input="hi", dimensions=0) == "dimensions"
    assert (
        refused("at most 4 \\(--max-embedding-inputs\\)", input=["a"] * (MAX_INPUTS + 1)) == "input"
    )
    assert (
        refused("at most 200 \\(--max-embedding-tokens\\)", input=[[5] * 120, [6] * 120]) == "input"
    )
    assert refused("must not be empty", input=[]) == "input"
    assert refused("empty string", input=["a", ""]) == "input"
    assert refused("not a token id", input=[[1, 10**9]]) == "input"
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="other", input="hi")


def test_generation_still_runs_beside_embeddings(client):
    """The same server answers completions while it embeds."""
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=4, temperature=0)
    assert r.usage.completion_tokens == 4
