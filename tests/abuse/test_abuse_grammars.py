"""Grammars and chat templates as a hostile client sends them, against a real
`asyncllm serve` (asyncllm-tiny) on loopback: regexes that would hold 100 MB of
lexer state are refused at once naming the bound and leave no memory behind;
costly grammars that are accepted compile at the lowest priority while a healthy
stream keeps its pace; `chat_template_kwargs` cannot replace what the server
sets; a `$ref` cycle, an unknown role and a request's own `chat_template` are
400s; a 100,000-part message leaves the front end as it was; a chunked body is
refused with 413 as soon as it crosses the limit."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import pytest
from abuse_cases import SERVED_MODEL, healthy_stream
from abuse_http import post_json, resident_kib, scrape

from server_process import Server

pytest.importorskip("openai")  # the healthy stream's client

pytestmark = pytest.mark.timeout(240)

BODY_LIMIT = 8 << 20
MAX_KWARGS = 4
MAX_KWARGS_BYTES = 2048
FLAGS = [
    "--max-request-body-bytes",
    str(BODY_LIMIT),
    "--max-chat-template-kwargs",
    str(MAX_KWARGS),
    "--max-chat-template-kwargs-bytes",
    str(MAX_KWARGS_BYTES),
]
MiB = 1024  # in KiB, as resident_kib answers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("abuse-grammars") / "server.log"
    # a loaded machine may give the lowest-priority compile threads little CPU:
    # these tests are about what compiles and what is refused, not how fast
    srv = Server(log, *FLAGS, env={"ASYNCLLM_GRAMMAR_COMPILE_DEADLINE_S": "300"})
    yield srv
    assert srv.stop() == 0, log.read_text()[-3000:]


def completion(port: int, constraint: dict, max_tokens: int = 8):
    body = {"model": SERVED_MODEL, "prompt": "{", "max_tokens": max_tokens}
    return post_json(port, "/v1/completions", {**body, "structured_outputs": constraint})


def chat(port: int, **fields):
    body = {"model": SERVED_MODEL, "max_tokens": 2, **fields}
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return post_json(port, "/v1/chat/completions", body)


def engine_core_pid(server: Server) -> int:
    """The engine core: the server's child with the largest resident set."""
    return max(server.children(), key=resident_kib)


def costly_schema(seed: int) -> dict:
    """A JSON schema within every bound (63 kB of text) that still costs ~0.2 s
    of CPU and ~10 MB to compile: 1,000 bounded integer properties."""
    props = {
        f"p{i}": {"type": "integer", "minimum": i, "maximum": i * 1000 + seed} for i in range(1000)
    }
    return {"type": "object", "properties": props}


@pytest.mark.parametrize("pattern", ["a{1000001}", "(a{1000}){1000}"])
def test_a_regex_past_the_budget_is_refused_naming_the_limit(server, pattern):
    asyncio.run(completion(server.port, {"regex": "warm-up"}))  # builds the compiler
    reply = asyncio.run(completion(server.port, {"regex": pattern}))
    assert reply.status == 400, reply.body
    error = reply.error()
    assert error["param"] == "structured_outputs"
    assert "max_literal_bytes=10000" in error["message"]  # (how fast: bench_abuse.py)


def test_refusing_costly_regexes_fifty_times_holds_no_memory(server):
    """Case 1 of the issue repeated: before, each such regex kept 75-180 MB in
    the engine core. Bound: 16 MiB of growth in either process after 50."""

    async def run() -> None:
        for i in range(5):  # warm-up: allocator arenas, the compiler, code paths
            await completion(server.port, {"regex": f"a{{{1000001 + i}}}"})
        core, front = engine_core_pid(server), server.proc.pid
        before = resident_kib(core), resident_kib(front)
        for i in range(50):  # a distinct count each time: nothing is cached
            reply = await completion(server.port, {"regex": f"a{{{1000100 + i}}}"})
            assert reply.status == 400
        after = resident_kib(core), resident_kib(front)
        growth = [(a - b) / MiB for a, b in zip(after, before, strict=True)]
        assert max(growth) < 16, f"RSS growth MiB (core, front end): {growth}"

    asyncio.run(run())


@pytest.mark.timeout(900)  # a hang guard: three costly compiles on a loaded box outran 240 s
def test_costly_grammars_compile_beside_a_healthy_stream(server):
    """Three accepted but costly grammars compile while a healthy stream runs,
    and the stream goes on to the same tokens it gives alone. (Its pace beside
    them — largest gap within 2x its gap alone — is bench_abuse.py's figure: a
    wall-clock bound fails on a loaded machine.)"""

    async def run() -> None:
        await healthy_stream(server.port, max_tokens=20)  # warm-up
        await completion(server.port, {"regex": "[0-9]+"})  # builds the compilers
        alone = await healthy_stream(server.port)
        beside = asyncio.ensure_future(healthy_stream(server.port))
        await asyncio.sleep(0.2)  # the stream is under way
        replies = await asyncio.gather(
            *(completion(server.port, {"json": costly_schema(s)}, 1) for s in range(3))
        )
        during = await beside
        assert [r.status for r in replies] == [200] * 3, [r.body[:300] for r in replies]
        assert during.text == alone.text

    asyncio.run(run())


def test_the_grammar_caches_bytes_are_on_metrics(server):
    async def run() -> None:
        reply = await completion(server.port, {"regex": "[0-9]{3}-[0-9]{4}"})
        assert reply.status == 200
        m = await scrape(server.port)
        assert m["asyncllm:grammar_cache_bytes"] > 0
        assert m["asyncllm:grammar_cache_entries"] >= 1
        assert m["asyncllm:frontend_grammar_cache_bytes"] > 0

    asyncio.run(run())


def test_a_ref_cycle_is_a_400(server):
    schema = {
        "$ref": "#/$defs/a",
        "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
    }
    reply = asyncio.run(completion(server.port, {"json": schema}))
    assert reply.status == 400, reply.body
    assert "$ref cycle" in reply.error()["message"]
    tree = {  # recursion through a property is a tree, not a cycle
        "type": "object",
        "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
    }
    assert asyncio.run(completion(server.port, {"json": tree})).status == 200


@pytest.mark.parametrize(
    "key", ["tools", "bos_token", "eos_token", "add_generation_prompt", "messages", "documents"]
)
def test_template_kwargs_cannot_set_what_the_server_sets(server, key):
    value = [{"type": "function", "function": {"name": "f"}}] * 10_000 if key == "tools" else "x"
    reply = asyncio.run(chat(server.port, chat_template_kwargs={key: value}))
    assert reply.status == 400, reply.body
    error = reply.error()
    assert error["param"] == "chat_template_kwargs"
    assert f"chat_template_kwargs.{key} is set by the server" in error["message"]


@pytest.mark.parametrize(
    ("kwargs", "says"),
    [
        ({f"k{i}": 1 for i in range(MAX_KWARGS + 1)}, "--max-chat-template-kwargs"),
        ({"big": "x" * MAX_KWARGS_BYTES}, "--max-chat-template-kwargs-bytes"),
        ({"deep": json.loads("[" * 20 + "]" * 20)}, "nested more than 8 levels"),
    ],
    ids=["keys", "bytes", "depth"],
)
def test_template_kwargs_are_bounded(server, kwargs, says):
    reply = asyncio.run(chat(server.port, chat_template_kwargs=kwargs))
    assert reply.status == 400, reply.body
    assert says in reply.error()["message"]


def test_other_template_kwargs_are_served(server):
    reply = asyncio.run(chat(server.port, chat_template_kwargs={"enable_thinking": False}))
    assert reply.status == 200, reply.body


def test_an_unknown_role_is_a_400(server):
    reply = asyncio.run(chat(server.port, messages=[{"role": "hacker", "content": "hi"}]))
    assert reply.status == 400
    assert reply.error()["param"] == "messages" and "'hacker'" in reply.error()["message"]


def test_a_request_template_is_refused_without_the_flag(server):
    reply = asyncio.run(chat(server.port, chat_template="{{ messages[0].content }}"))
    assert reply.status == 400
    error = reply.error()
    assert error["param"] == "chat_template"
    assert "--trust-request-chat-template" in error["message"]


def test_a_100000_part_message_is_refused_and_leaves_no_memory(server):
    parts = [{"type": "text", "text": "a"}] * 100_000
    body = {
        "model": SERVED_MODEL,
        "max_tokens": 2,
        "messages": [{"role": "user", "content": parts}],
    }

    body_mib = len(json.dumps(body)) / MiB

    async def run() -> None:
        for _ in range(2):  # warm-up: the parser's and allocator's first growth
            await post_json(server.port, "/v1/chat/completions", body)
        # RSS after each round of 5. A leak of even the raw body grows every round by
        # 5 bodies (15 MiB; the parsed parts are ~10x that); the allocator's one-off
        # growth (arenas of threads that ran beside the first rounds on a loaded
        # machine, seen up to 8 MiB) shows once, so the bound sits between the two
        # and is measured from the end of the second round
        rss = []
        for _ in range(6):
            for _ in range(5):
                reply = await post_json(server.port, "/v1/chat/completions", body)
                assert reply.status == 400, reply.body
                assert "at most 1024 items" in reply.error()["message"]
            rss.append(resident_kib(server.proc.pid))
        growth = (rss[-1] - rss[1]) / MiB
        leak = 20 * body_mib  # what keeping each refused body would cost over 4 rounds
        assert growth < leak / 4, (
            f"front end grew {growth:.1f} MiB over 20 requests of {body_mib:.1f} MiB ({rss} KiB)"
        )

    asyncio.run(run())


def test_a_chunked_body_is_refused_as_it_crosses_the_limit(server):
    """One chunk declared far larger than the limit and sent without end: the
    413 comes once the limit is crossed, not after --body-timeout."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % (4 * BODY_LIMIT)
        )
        start = time.perf_counter()
        sent = 0
        try:
            while sent <= BODY_LIMIT + (1 << 20):
                sock.sendall(b"a" * 65536)
                sent += 65536
        except OSError:
            pass  # the server answered and closed while we still sent
        head = sock.recv(64)
    assert head.startswith(b"HTTP/1.1 413"), head
    assert time.perf_counter() - start < 5


def test_a_trusting_server_renders_a_request_template_in_the_sandbox(tmp_path):
    srv = Server(tmp_path / "trusting.log", "--trust-request-chat-template")
    try:
        ok = asyncio.run(chat(srv.port, chat_template="{{ bos_token }}{{ messages[0].content }}"))
        assert ok.status == 200, ok.body
        # the sandbox: no attribute walk out of the template
        escape = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
        reply = asyncio.run(chat(srv.port, chat_template=escape))
        assert reply.status == 400 and reply.error()["param"] in ("messages", "chat_template")
        bad = asyncio.run(chat(srv.port, chat_template="{% if %}"))
        assert bad.status == 400 and bad.error()["param"] == "chat_template"
    finally:
        assert srv.stop() == 0
