"""Constrained decoding end to end on the shipped asyncllm-tiny (random-ish
weights for this purpose, temperature 1.0 with seeds, so the mask does the work):
every output matches its JSON schema, regex, choice list or Lark grammar; the
tokens of a seeded request do not depend on the batch, the prefix cache or
preemption; bad constraints fail alone with a message naming the problem."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from structured_cases import GRAMMAR, LARK_EXPR, REGEXES, SCHEMAS

from asyncllm import LLM, ConfigError, InvalidRequestError, SamplingParams, StructuredOutputsParams


def constrained(seed: int, max_tokens: int = 64, **so) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**so),
    )


def generate(llm: LLM, params: list[SamplingParams], prompt: str = "Answer:") -> list:
    return [o.outputs[0] for o in llm.generate([prompt] * len(params), params, use_tqdm=False)]


@pytest.fixture(scope="module")
def llm(scheduling_mode):
    """Built once per scheduling mode: the tests that use it run with and without
    overlap scheduling (conftest.scheduling_mode)."""
    with LLM(multiprocess=False, max_num_seqs=64) as engine:
        yield engine


@pytest.fixture(scope="module")
def llm1():
    """The default mode only, for what scheduling cannot change (compile errors,
    the shape of one request's output)."""
    with LLM(multiprocess=False, max_num_seqs=64) as engine:
        yield engine


def test_json_schemas_every_output_validates(llm):
    outs = generate(llm, [constrained(i, json=s) for i, s in enumerate(SCHEMAS)])
    for schema, out in zip(SCHEMAS, outs, strict=True):
        assert out.finish_reason == "stop", (schema, out.text)
        jsonschema.validate(json.loads(out.text), schema)


def test_json_object_and_regexes_and_choice(llm1):
    llm = llm1
    params = [constrained(i, max_tokens=12, json_object=True) for i in range(4)]
    params += [constrained(i, regex=r) for i, r in enumerate(REGEXES)]
    choices = ["alpha", "beta", "gamma delta"]
    params += [constrained(i, max_tokens=8, choice=choices) for i in range(6)]
    outs = generate(llm, params)
    for out in outs[:4]:  # any object: keys and strings unbounded, so it may be cut
        assert out.text.startswith("{")
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)
        else:
            assert out.finish_reason == "length"
    for regex, out in zip(REGEXES, outs[4:14], strict=True):
        assert out.finish_reason == "stop"
        assert re.fullmatch(regex, out.text), (regex, out.text)
    for out in outs[14:]:
        assert out.finish_reason == "stop"
        assert out.text in choices


def test_lark_grammar(llm1):
    outs = generate(llm1, [constrained(i, max_tokens=32, grammar=GRAMMAR) for i in range(6)])
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert LARK_EXPR.fullmatch(out.text), out.text
        assert out.text.count("(") == out.text.count(")")


def test_max_tokens_cuts_with_length(llm1):
    schema = {"type": "array", "items": {"type": "integer"}}
    [out] = generate(llm1, [constrained(0, max_tokens=3, json=schema)])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 3
    assert out.text.startswith("[")


def test_n_children_each_follow_the_grammar(llm1):
    llm = llm1
    params = SamplingParams(
        n=4,
        temperature=1.0,
        seed=5,
        max_tokens=8,
        structured_outputs=StructuredOutputsParams(regex=r"[0-9]{2}"),
    )
    [out] = llm.generate(["Number:"], params, use_tqdm=False)
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and re.fullmatch(r"[0-9]{2}", c.text)


def test_same_tokens_alone_batched_cached_and_preempted(llm):
    schema = SCHEMAS[1]
    probe = [constrained(7, max_tokens=32, json=schema), constrained(8, regex=REGEXES[2])]
    alone = [generate(llm, [p])[0].token_ids for p in probe]
    filler = [
        constrained(100 + i, max_tokens=16, json=SCHEMAS[i % len(SCHEMAS)]) for i in range(62)
    ]
    batched = generate(llm, probe + filler)
    assert [o.token_ids for o in batched[:2]] == alone
    # prefix caching off, and a KV cache so small that requests get preempted
    for kwargs in (
        {"enable_prefix_caching": False},
        {"num_kv_blocks": 12, "block_size": 8, "max_model_len": 48},
    ):
        with LLM(multiprocess=False, max_num_seqs=64, **kwargs) as other:
            outs = generate(other, probe + filler[:14])
            preemptions = other.engine.core.scheduler.num_preemptions
        assert [o.token_ids for o in outs[:2]] == alone, kwargs
        if "num_kv_blocks" in kwargs:
            assert preemptions > 0
        for p, out in zip(probe + filler[:14], outs, strict=True):
            spec = p.structured_outputs
            if spec is not None and spec.json is not None and out.finish_reason == "stop":
                jsonschema.validate(json.loads(out.text), spec.json)


@pytest.mark.parametrize(
    "so, message",
    [
        ({"json": {"type": "nonsense"}}, "invalid JSON schema"),
        ({"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}, "JSON schema"),
        ({"regex": "(unclosed"}, "invalid regex"),
        ({"grammar": "start: missing_rule"}, "invalid grammar"),
    ],
)
def test_bad_constraints_fail_alone(llm1, so, message):
    llm = llm1
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    # a grammar too large to send at all
    with pytest.raises(ConfigError, match="at most 65536 chars"):
        StructuredOutputsParams(grammar="start: " + " ".join(['"k"'] * 20_000))
    # the engine keeps serving
    [out] = generate(llm, [constrained(1, max_tokens=4, choice=["ok"])])
    assert out.text == "ok"


def test_core_process_compiles_and_constrains():
    with LLM(multiprocess=True, max_num_seqs=8) as llm:
        outs = generate(llm, [constrained(i, json=SCHEMAS[i]) for i in range(4)])
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            llm.generate(["x"], constrained(0, regex="(("))
    for schema, out in zip(SCHEMAS, outs, strict=False):
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), schema)


def test_http_response_format_and_structured_outputs(tmp_path):
    """The real server with the official client: json_schema on chat, json_object
    and vLLM's structured_outputs on completions, bad constraints a 400 naming
    the problem while the server keeps serving."""
    openai = pytest.importorskip("openai")
    from server_process import Server

    srv = Server(tmp_path / "server.log", "asyncllm-tiny", "--served-model-name", "tiny")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        schema = SCHEMAS[1]
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Who are you?"}],
            max_tokens=48,
            seed=3,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": schema, "strict": True},
            },
        )
        choice = chat.choices[0]
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
        comp = client.completions.create(
            model="tiny",
            prompt="Color:",
            max_tokens=8,
            seed=1,
            extra_body={"structured_outputs": {"choice": ["red", "green"]}},
        )
        assert comp.choices[0].text in ("red", "green")
        obj = client.completions.create(
            model="tiny",
            prompt="{",
            max_tokens=6,
            extra_body={"response_format": {"type": "json_object"}},
        )
        assert obj.choices[0].text.startswith("{")
        for extra, message in [
            ({"structured_outputs": {"regex": "(("}}, "invalid regex"),
            (
                {
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": {"type": 7}},
                    }
                },
                "JSON schema",
            ),
            ({"structured_outputs": {"grammar": "start: nowhere"}}, "invalid grammar"),
            ({"structured_outputs": {"xml": "<a/>"}}, "unknown field"),
        ]:
            with pytest.raises(openai.BadRequestError) as bad:
                client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body=extra)
            assert message in bad.value.message, bad.value.message
        ok = client.completions.create(model="tiny", prompt="still", max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        assert srv.stop() == 0, srv.log.read_text()[-3000:]
