"""Prefix-cache keys and what the prefix cache reports: SHA-256 block keys chained
over the whole prefix and the cache salt, salts that isolate requests, prompt
logprobs that bypass the cache, and `num_cached_tokens` from the scheduler to
`RequestOutput` and the server's usage."""

from __future__ import annotations

import hashlib
import json
import struct
import urllib.request

import pytest

from asyncllm import LLM, SamplingParams
from asyncllm._core import BLOCK_HASH_LEN, block_hash_root, hash_blocks
from asyncllm.core.kv_cache_manager import KVCacheManager
from asyncllm.core.request import Request
from asyncllm.core.scheduler import Scheduler
from asyncllm.errors import ConfigError
from server_process import Server, post

BLOCK = 4


def make_request(
    rid: int, prompt: list[int], salt: str | None = None, max_tokens: int = 2, **params
) -> Request:
    return Request(
        rid,
        list(prompt),
        SamplingParams(max_tokens=max_tokens, cache_salt=salt, **params),
        eos_token_ids=[0],
        max_model_len=256,
        block_size=BLOCK,
        hash_blocks=True,
    )


def run_to_end(sched: Scheduler) -> None:
    while sched.has_unfinished_requests():
        so = sched.schedule()
        sampled = {
            rid: 7
            for rid, n in so.num_scheduled_tokens.items()
            if sched.requests[rid].num_computed_tokens + n == sched.requests[rid].num_tokens
        }
        sched.update_from_output(so, sampled)


def serve_one(sched: Scheduler, request: Request) -> int:
    """Runs `request` alone to the end; returns its prompt tokens found in the cache."""
    sched.add_request(request)
    run_to_end(sched)
    return request.num_cached_prompt_tokens


def make_scheduler() -> Scheduler:
    return Scheduler(
        KVCacheManager(64, BLOCK, True),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=256,
    )


# --- the keys ------------------------------------------------------------------------


def reference_keys(salt: str | None, tokens: list[int], block_size: int) -> list[bytes]:
    """The documented layout (rust/prefix_hash.rs), recomputed with hashlib."""
    domain = b"asyncllm prefix-cache block v1\0"
    root = domain + (b"\0" if salt is None else b"\1" + salt.encode())
    parent = hashlib.sha256(root).digest()
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
        parent = hashlib.sha256(parent + block).digest()
        keys.append(parent)
    return keys


@pytest.mark.parametrize("salt", [None, "tenant-a", "ünïcode 💥"])
def test_block_keys_are_sha256_chained_over_the_prefix_and_salt(salt):
    tokens = [5, 150_000, 2**32 - 1, 0, 9, 8, 7, 6, 1, 2]
    request = make_request(1, tokens, salt)
    assert request.block_hashes == reference_keys(salt, tokens, BLOCK)
    assert len(request.block_hashes) == 2 and all(
        len(k) == BLOCK_HASH_LEN for k in request.block_hashes
    )


def test_keys_are_equal_for_equal_salt_and_prefix_and_differ_otherwise():
    prefix = list(range(1, 13))
    a = make_request(1, prefix + [40, 41, 42, 43], "a")
    a_again = make_request(2, prefix + [50, 51, 52, 53], "a")
    b = make_request(3, prefix + [40, 41, 42, 43], "b")
    unsalted = make_request(4, prefix + [40, 41, 42, 43])
    assert a.block_hashes[:3] == a_again.block_hashes[:3]  # same salt, same prefix
    assert a.block_hashes[3] != a_again.block_hashes[3]  # the fourth blocks differ
    for other in (b, unsalted):
        assert not set(a.block_hashes) & set(other.block_hashes)


def test_a_key_stands_for_its_whole_prefix():
    a = make_request(1, [1, 2, 3, 4, 5, 6, 7, 8])
    b = make_request(2, [9, 2, 3, 4, 5, 6, 7, 8])  # same second block, other first
    assert a.block_hashes[1] != b.block_hashes[1]


def test_decode_blocks_chain_from_the_prompt_blocks():
    sched = make_scheduler()
    request = make_request(1, [1, 2, 3, 4, 5, 6], "s", max_tokens=6)
    serve_one(sched, request)
    assert request.all_token_ids == [1, 2, 3, 4, 5, 6] + [7] * 6
    assert request.block_hashes == reference_keys("s", request.all_token_ids, BLOCK)


def test_hash_blocks_rejects_bad_arguments():
    root = block_hash_root(None)
    with pytest.raises(ValueError, match="32-byte"):
        hash_blocks(root[:31], [1, 2, 3, 4], 4)
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks(root, [1, 2, 3, 4], 0)
    with pytest.raises(ValueError, match=r"token_ids\[1\]"):
        hash_blocks(root, [1, 2**32, 3, 4], 4)
    assert hash_blocks(root, [1, 2, 3], 4) == []


# --- salts isolate requests in the cache -----------------------------------------------


def test_requests_with_different_salts_share_no_blocks():
    sched = make_scheduler()
    prompt = list(range(1, 18))  # 4 full blocks
    assert serve_one(sched, make_request(1, prompt, "tenant-a")) == 0
    assert serve_one(sched, make_request(2, prompt, "tenant-b")) == 0
    assert serve_one(sched, make_request(3, prompt)) == 0  # no salt is a salt of its own
    assert sched.kv_cache.prefix_cache_hits == 0


def test_requests_with_the_same_salt_share_blocks():
    sched = make_scheduler()
    prompt = list(range(1, 18))
    assert serve_one(sched, make_request(1, prompt, "tenant-a")) == 0
    assert serve_one(sched, make_request(2, prompt, "tenant-a")) == 16
    assert serve_one(sched, make_request(3, prompt)) == 0
    assert serve_one(sched, make_request(4, prompt)) == 16


def test_prompt_logprobs_zero_bypasses_the_cache():
    sched = make_scheduler()
    prompt = list(range(1, 18))
    serve_one(sched, make_request(1, prompt))
    assert serve_one(sched, make_request(2, prompt, prompt_logprobs=0)) == 0
    assert serve_one(sched, make_request(3, prompt)) == 16


@pytest.mark.parametrize(
    ("salt", "message"),
    [
        ("", "non-empty string of at most 256 characters"),
        ("x" * 257, "non-empty string of at most 256 characters"),
        (7, "non-empty string"),
        ("\ud800", "non-empty string"),
    ],
)
def test_cache_salt_is_validated(salt, message):
    with pytest.raises(ConfigError, match="cache_salt") as info:
        SamplingParams(cache_salt=salt)
    assert message in str(info.value)
    assert "x" * 50 not in str(info.value)  # a long salt is not echoed whole
    SamplingParams(cache_salt="x" * 256)


# --- end to end: the shipped model -------------------------------------------------------


@pytest.fixture(scope="module")
def llm(scheduling_mode):
    with LLM(multiprocess=False, dtype="float32", block_size=16) as llm:
        yield llm


def prompt_of(n: int, seed: int) -> list[int]:
    """`n` token ids inside asyncllm-tiny's vocabulary (8192), the same for a seed."""
    return [(seed * 7919 + i * 104_729) % 8000 + 100 for i in range(n)]


@pytest.mark.usefixtures("scheduling_mode")
def test_a_cache_hit_still_delivers_prompt_logprobs_zero(llm):
    prompt = prompt_of(40, seed=1)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0)
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    # The same prompt again, once without prompt logprobs (to fill the cache) and
    # then with prompt_logprobs=0: the second must not take the cached blocks.
    llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0
    assert second.prompt_logprobs is not None and len(second.prompt_logprobs) == len(prompt)
    pairs = zip(first.prompt_logprobs[1:], second.prompt_logprobs[1:], strict=True)
    for token, (a, b) in zip(prompt[1:], pairs, strict=True):
        assert list(a) == list(b) == [token]
        assert a[token].logprob == pytest.approx(b[token].logprob, abs=1e-5)


@pytest.mark.usefixtures("scheduling_mode")
def test_num_cached_tokens_reaches_the_request_output(llm):
    prompt = prompt_of(40, seed=2)  # two full blocks of 16 can be shared
    greedy = dict(max_tokens=3, temperature=0.0)
    cold = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    warm = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0]
    salted = llm.generate([prompt], SamplingParams(**greedy, cache_salt="t1"), use_tqdm=False)[0]
    salted_again = llm.generate(
        [prompt], SamplingParams(**greedy, cache_salt="t1"), use_tqdm=False
    )[0]
    assert cold.num_cached_tokens == 0
    assert warm.num_cached_tokens == 32
    assert salted.num_cached_tokens == 0
    assert salted_again.num_cached_tokens == 32
    texts = {o.outputs[0].text for o in (cold, warm, salted, salted_again)}
    assert len(texts) == 1  # cached or not, greedy gives the same tokens
    assert not llm.engine.core._awaiting_first_output  # nothing left behind


@pytest.mark.usefixtures("scheduling_mode")
def test_num_cached_tokens_crosses_the_process_boundary():
    with LLM(dtype="float32", block_size=16) as llm:
        prompt = prompt_of(40, seed=3)
        params = SamplingParams(max_tokens=2, temperature=0.0, cache_salt="proc")
        outs = [llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2)]
    assert [o.num_cached_tokens for o in outs] == [0, 32]


# --- the server -------------------------------------------------------------------------


def stream_usage(url: str, body: dict) -> dict:
    """The usage object of a streamed response (its last data chunk before [DONE])."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines() if line[:6] == "data: "]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "serve.log"
    srv = Server(log, "--dtype", "float32")
    yield srv
    srv.stop()


@pytest.mark.timeout(120)
def test_server_reports_cached_tokens_and_takes_cache_salt(server):
    prompt = prompt_of(40, seed=4)
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0.0}
    url = server.url + "/v1/completions"
    usages = [post(url, body)[1]["usage"] for _ in range(2)]
    assert [u["prompt_tokens_details"]["cached_tokens"] for u in usages] == [0, 32]
    status, salted = post(url, {**body, "cache_salt": "tenant-a"})
    assert status == 200 and salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    stream = {**body, "cache_salt": "tenant-a", "stream": True}
    stream["stream_options"] = {"include_usage": True}
    assert stream_usage(url, stream)["prompt_tokens_details"]["cached_tokens"] == 32
    chat = {"messages": [{"role": "user", "content": "hello there " * 20}], "max_tokens": 2}
    chat_url = server.url + "/v1/chat/completions"
    first = post(chat_url, {**chat, "cache_salt": "c"})[1]["usage"]
    second = stream_usage(
        chat_url,
        {**chat, "cache_salt": "c", "stream": True, "stream_options": {"include_usage": True}},
    )
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens"] == first["prompt_tokens"] > 32
    assert second["prompt_tokens_details"]["cached_tokens"] == 16 * (
        (first["prompt_tokens"] - 1) // 16
    )
    status, error = post(url, {**body, "cache_salt": "x" * 300})
    assert status == 400
    assert error["error"]["param"] == "cache_salt"
    assert "256" in error["error"]["message"]
