"""Constrained decoding end to end on the shipped asyncllm-tiny (random-ish
weights for this purpose, temperature 1.0 with seeds, so the mask does the work):
every output matches its JSON schema, regex, choice list or Lark grammar; the
tokens of a seeded request do not depend on the batch, the prefix cache or
preemption; bad constraints fail alone with a message naming the problem."""

from __future__ import annotations

import asyncio
import json
import re

import jsonschema
import numpy as np
import pytest
from structured_cases import GRAMMAR, LARK_EXPR, REGEXES, SCHEMAS

from asyncllm import (
    LLM,
    ConfigError,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from asyncllm.default_model import default_model_path
from asyncllm.structured_output.grammar_cache import GrammarCache


def constrained(seed: int, max_tokens: int = 64, **so) -> SamplingParams:
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(**so),
    )


def tiny_grammars() -> GrammarCache:
    """A fresh grammar cache for asyncllm-tiny's tokenizer (EOS 2, 8192 logits)."""
    return GrammarCache(default_model_path() / "tokenizer.json", [2], 8192)


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


def test_min_tokens_past_a_complete_grammar_the_grammar_wins(llm):
    """A grammar that is complete before min_tokens allows only EOS, which
    min_tokens bans: the grammar wins, the request stops there ("stop") with the
    same tokens as without min_tokens, instead of sampling from no allowed token."""
    choices = ["yes", "no"]
    free = [constrained(i, max_tokens=20, choice=choices) for i in range(4)]
    held = [p.clone(min_tokens=12) for p in free]
    outs = generate(llm, free + held)
    for a, b in zip(outs[:4], outs[4:], strict=True):
        assert b.finish_reason == "stop" and b.text in choices, b
        assert b.token_ids == a.token_ids
    # where the grammar may go on, min_tokens still holds: digits past EOS's place
    params = [
        constrained(i, max_tokens=12, regex="[0-9]{1,10}").clone(min_tokens=6) for i in range(4)
    ]
    for out in generate(llm, params):
        assert re.fullmatch("[0-9]{1,10}", out.text), out.text
        assert len(out.token_ids) >= 6 or out.finish_reason == "stop", out


def test_rows_in_one_state_share_a_mask_and_equal_their_own_fill():
    """fill_bitmasks over matchers at mixed places (twins of one state, two
    grammars, serial or on a pool) writes each row what that matcher alone gets."""
    c = tiny_grammars().compiler
    g = c.compile("json", json.dumps(SCHEMAS[1]))
    h = c.compile("regex", "[a-c]{2,6}")
    ms = []
    for i in range(24):
        m = (g if i % 3 else h).matcher()
        for _ in range(i % 4):  # walk a few allowed tokens, the same ones for twins
            row = np.zeros((1, c.words), dtype=np.int32)
            c.fill_bitmasks([m], row, [0])
            bits = np.unpackbits(row[0].view(np.uint8), bitorder="little")
            m.consume([int(np.flatnonzero(bits)[0])])
        ms.append(m)
    for threads in (1, 2):
        out = np.zeros((24, c.words), dtype=np.int32)
        c.fill_bitmasks(ms, out, list(range(24)), threads)
        for i, m in enumerate(ms):
            alone = np.zeros((1, c.words), dtype=np.int32)
            c.fill_bitmasks([m], alone, [0])
            assert (out[i] == alone[0]).all(), (threads, i)
    with pytest.raises(ValueError, match="threads"):
        c.fill_bitmasks(ms[:1], out, [0], 0)


def test_compile_async_leaves_the_event_loop_free():
    """The server compiles off its event loop: while a schema compiles, the loop
    keeps running other work (here a ticker), and a cached one returns at once."""
    cache = tiny_grammars()
    params = StructuredOutputsParams(json=SCHEMAS[5])

    async def main() -> int:
        task = asyncio.create_task(cache.compile_async(params))
        ticks = 0
        while not task.done():
            ticks += 1
            await asyncio.sleep(0)
        first = task.result()
        again = await cache.compile_async(params)
        assert again is first
        with pytest.raises(InvalidRequestError, match="invalid regex"):
            await cache.compile_async(StructuredOutputsParams(regex="(("))
        return ticks

    ticks = asyncio.run(main())
    # compiled inline, the task would finish in the loop's first turn after it
    assert ticks >= 2


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


def test_the_ban_is_lifted_only_where_the_grammar_allows_nothing_else():
    """Both samplers' rule (let_grammar_win): a row's min_tokens ban goes only where
    its grammar allows no token outside it; other rows keep theirs."""
    from asyncllm.worker.sampling_metadata import SamplingMetadata, TokenLists, let_grammar_win

    eos, other, words = 2, 40, 4
    bitmask = np.zeros((3, words), dtype=np.int32)
    bitmask[0, 0] = 1 << eos  # complete: EOS only
    bitmask[1, 0] = 1 << eos
    bitmask[1, other // 32] |= 1 << (other % 32)  # EOS or another token
    bitmask[2, 0] = 1 << eos  # complete, but not banned
    banned = TokenLists(
        np.array([0, 2, 4, 4], dtype=np.int64),  # rows 0 and 1 ban EOS and 33
        np.array([eos, 33, eos, 33], dtype=np.int64),
        np.zeros(4, dtype=np.int64),
    )
    md = SamplingMetadata(
        all_greedy=True,
        params_f=np.zeros((3, 6), dtype=np.float32),
        params_i=np.zeros((3, 6), dtype=np.int64),
        seen=None,
        banned=banned,
        max_num_logprobs=None,
        allowed=(np.arange(3, dtype=np.int64), bitmask),
    )
    let_grammar_win(md)
    assert md.banned is not None
    assert md.banned.offsets.tolist() == [0, 0, 2, 2]
    assert md.banned.tokens.tolist() == [eos, 33]
