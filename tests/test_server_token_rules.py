"""OpenAI's `logit_bias` and vLLM's `allowed_token_ids` and `bad_words` through a
real server process and the official `openai` client, on both endpoints: what
they do to the output, and the 400s that name the field and the limit."""

from __future__ import annotations

import re

import pytest

from asyncllm.frontend.tokenizer import Tokenizer
from server_process import Server
from tiny_models import make_tiny_model

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.timeout(120)

MODEL = "tiny"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPT = "Once upon a time"
MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("llama"), arch="llama", tokenizer="llama-2")


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def client(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    srv = Server(
        tmp / "server.log",
        str(model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--chat-template",
        str(template),
    )
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    assert srv.stop() == 0, srv.log.read_text()[-3000:]


def completion_ids(client, tok: Tokenizer, **kw) -> list[int]:
    """The completion's token ids, via its logprobs' token strings (each one token)."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, logprobs=0, **kw)
    return [tok_id(tok, t) for t in out.choices[0].logprobs.tokens]


def tok_id(tok: Tokenizer, text: str) -> int:
    ids = tok.encode(text, add_special_tokens=False)
    return ids[-1]


def test_logit_bias_100_forces_a_token_on_both_endpoints(client, tok) -> None:
    x = tok.token_to_id("x")
    assert x is not None
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(x): 100}
    )
    assert out.choices[0].text == "x" * 6
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=1.0, seed=4,
        logit_bias={str(x): 100},
    )  # fmt: skip
    assert chat.choices[0].message.content == "x" * 5
    # -100 on the greedy choice changes it
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0)
    greedy = first.choices[0].text
    pushed = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=1,
        temperature=0,
        logprobs=0,
        logit_bias={str(tok_id(tok, greedy)): -100},
    )
    assert pushed.choices[0].text != greedy


def test_allowed_token_ids_restrict_the_output(client, tok) -> None:
    allowed = [tok.token_to_id(c) for c in "xyz"]
    assert None not in allowed
    for seed in range(3):
        out = client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=1.0,
            seed=seed,
            extra_body={"allowed_token_ids": allowed},
        )
        assert re.fullmatch("[xyz]{12}", out.choices[0].text), out.choices[0].text
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=1.0, seed=1,
        extra_body={"allowed_token_ids": allowed},
    )  # fmt: skip
    assert re.fullmatch("[xyz]{8}", chat.choices[0].message.content)


def test_bad_words_never_appear_even_against_a_bias(client, tok) -> None:
    the = tok.token_to_id("\u2581the")  # SentencePiece's word-initial "the"
    assert the is not None
    bias = {str(the): 100}
    forced = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logit_bias=bias
    )
    assert forced.choices[0].text.split() == ["the"] * 4
    out = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=16,
        temperature=0,
        logit_bias=bias,
        extra_body={"bad_words": ["the"]},
    )
    assert "the" not in out.choices[0].text.split(), out.choices[0].text
    ids = completion_ids(
        client, tok, max_tokens=16, temperature=0, logit_bias=bias,
        extra_body={"bad_words": ["the"]},
    )  # fmt: skip
    assert the not in ids
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logit_bias=bias,
        extra_body={"bad_words": ["the"]},
    )  # fmt: skip
    assert "the" not in chat.choices[0].message.content.split()


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"logit_bias": {"5": 100.5}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {"abc": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias", "not a token id in [0, 32000)"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "at most 300"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
        ({"allowed_token_ids": [32000]}, "allowed_token_ids", "[0, 32000)"),
        ({"bad_words": ["w"] * 129}, "bad_words", "at most 128"),
        ({"bad_words": [""]}, "bad_words", "non-empty strings"),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bad_values_are_400s_naming_the_field_and_limit(
    client, endpoint: str, body: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "completions":
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=body)
        else:
            client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=body
            )
    error = info.value.body
    assert info.value.status_code == 400
    assert error["param"] == param, error
    assert says in error["message"], error
