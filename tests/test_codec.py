"""The wire codec through its Python API (`asyncllm._core`): exact round trips of
seeded-random messages, every malformed-frame class raising `WireError` with a
message naming the problem, the golden fixtures, and the GIL being released."""

from __future__ import annotations

import importlib.util
import math
import random
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from asyncllm import _core
from asyncllm._core import (
    AddRequest,
    Logprobs,
    Ready,
    SchedulerStats,
    WireError,
    decode_message,
    encode_abort,
    encode_add_request,
    encode_add_requests,
    encode_engine_error,
    encode_output_batch,
    encode_ready,
    encode_shutdown,
    encode_utility_call,
    encode_utility_result,
)

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def _load_fixture_script() -> Any:
    spec = importlib.util.spec_from_file_location(
        "make_wire_fixtures", FIXTURES / "make_wire_fixtures.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wire = _load_fixture_script()

U64_MAX = 2**64 - 1
U32_MAX = 2**32 - 1
REQUEST_FIELDS = wire.ADD_REQUEST_FIELDS  # the table's order (engine/wire_schema.py)


def f32(x: float) -> float:
    """`x` rounded to float32, as the wire carries it."""
    return float(struct.unpack("<f", struct.pack("<f", x))[0])


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def same(a: Any, b: Any) -> bool:
    """Deep equality with floats compared bit for bit (NaN == NaN, 0.0 != -0.0)."""
    if isinstance(a, float) and isinstance(b, float):
        return bits(a) == bits(b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def make_request(d: dict[str, Any]) -> AddRequest:
    rest = {k: v for k, v in d.items() if k not in ("wire_id", "prompt_token_ids")}
    return AddRequest(d["wire_id"], d["prompt_token_ids"], **rest)


def request_dict(r: AddRequest) -> dict[str, Any]:
    return {name: getattr(r, name) for name in REQUEST_FIELDS}


# --- seeded-random messages ---


def edgy_int(rng: random.Random, hi: int) -> int:
    edges = [0, 1, 127, 128, 255, 256, 65535, 65536, U32_MAX, hi]
    return rng.choice([e for e in edges if e <= hi]) if rng.random() < 0.3 else rng.randint(0, hi)


def any_float(rng: random.Random) -> float:
    choice = rng.random()
    if choice < 0.2:
        return rng.choice([0.0, -0.0, math.inf, -math.inf, math.nan])
    if choice < 0.4:
        return float(struct.unpack("<d", rng.randbytes(8))[0])
    return rng.uniform(-1e6, 1e6)


def random_request(rng: random.Random) -> AddRequest:
    maybe = lambda f: None if rng.random() < 0.5 else f()  # noqa: E731
    return AddRequest(
        edgy_int(rng, U64_MAX),
        [rng.randint(0, U32_MAX) for _ in range(rng.randint(0, 300))],
        arrival_time=any_float(rng),
        priority=rng.randint(-(2**31), 2**31 - 1),
        max_tokens=edgy_int(rng, U32_MAX),
        min_tokens=edgy_int(rng, U32_MAX),
        temperature=any_float(rng),
        top_p=rng.random(),
        top_k=rng.choice([0, -1, 1, 50, 2**31 - 1]),
        min_p=rng.random(),
        seed=maybe(lambda: edgy_int(rng, U64_MAX)),
        stop_token_ids=[rng.randint(0, U32_MAX) for _ in range(rng.randint(0, 4))],
        ignore_eos=rng.random() < 0.5,
        logprobs=maybe(lambda: rng.randint(0, 20)),
        prompt_logprobs=maybe(lambda: edgy_int(rng, U32_MAX)),
        repetition_penalty=any_float(rng),
        frequency_penalty=rng.uniform(-2, 2),
        presence_penalty=rng.uniform(-2, 2),
        cache_salt=maybe(lambda: rng.choice(["", "tenant-a", "ünïcode 💥", "x" * 300])),
        structured_outputs=maybe(
            lambda: (rng.choice(["json", "regex", "choice", "grammar"]), "ß" * rng.randint(0, 50))
        ),
        logit_bias={rng.randint(0, U32_MAX): any_float(rng) for _ in range(rng.randint(0, 3))},
        allowed_token_ids=[rng.randint(0, U32_MAX) for _ in range(rng.randint(0, 3))],
        bad_words_token_ids=[
            [rng.randint(0, U32_MAX) for _ in range(rng.randint(0, 3))]
            for _ in range(rng.randint(0, 2))
        ],
    )


def test_add_requests_round_trip_exactly() -> None:
    rng = random.Random(1234)
    for _ in range(200):
        requests = [random_request(rng) for _ in range(rng.randint(0, 6))]
        msg_type, decoded = decode_message(encode_add_requests(requests))
        assert msg_type == _core.MSG_ADD_REQUESTS
        assert len(decoded) == len(requests)
        for got, want in zip(decoded, requests, strict=True):
            assert got == want
            assert same(request_dict(got), request_dict(want))
            assert got.num_prompt_tokens == len(want.prompt_token_ids)


def test_single_add_request_is_a_burst_of_one() -> None:
    r = AddRequest(3, (5, 6, 7), seed=11, stop_token_ids=range(3))
    assert encode_add_request(r) == encode_add_requests([r])
    _, [back] = decode_message(encode_add_request(r))
    assert back.prompt_token_ids == [5, 6, 7]
    assert back.stop_token_ids == [0, 1, 2]
    assert back.seed == 11


def test_add_request_defaults_and_f32_rounding() -> None:
    r = AddRequest(1, [])
    # the generated class's defaults are the table's
    expected = {f.name: wire.default_value(f) for f in wire.ADD_REQUEST}
    assert request_dict(r) == expected | {"wire_id": 1, "prompt_token_ids": []}
    assert expected["max_tokens"] == 16 and expected["temperature"] == 1.0
    assert expected["stop_token_ids"] == [] and expected["logit_bias"] == {}
    assert AddRequest(1, [], top_p=0.1).top_p == f32(0.1)


def test_cache_salt_round_trips_with_and_without_a_salt() -> None:
    for salt in (None, "tenant-a", "ünïcode 💥"):
        _, [back] = decode_message(encode_add_request(AddRequest(1, [5, 6], cache_salt=salt)))
        assert back.cache_salt == salt
    # A request without a salt and one with a salt are different requests.
    assert AddRequest(1, [5], cache_salt="a") != AddRequest(1, [5])


def random_logprobs(rng: random.Random) -> tuple[list[int], list[float], list[int]]:
    k, w = rng.randint(1, 4), rng.randint(1, 6)
    ids = [rng.randint(0, U32_MAX) for _ in range(k * w)]
    values = [f32(-rng.expovariate(1.0)) for _ in range(k * w)]
    return ids, values, [rng.randint(1, 1000) for _ in range(k)]


def test_output_batches_round_trip_exactly() -> None:
    rng = random.Random(99)
    reasons = [None, None, "stop", "length", "abort", "error"]
    for _ in range(200):
        n = rng.randint(0, 40)
        cols: dict[str, Any] = {
            "wire_ids": [edgy_int(rng, U64_MAX) for _ in range(n)],
            "new_token_ids": [
                [rng.randint(0, U32_MAX) for _ in range(rng.randint(0, 5))] for _ in range(n)
            ],
        }
        optional = {
            "finish_reasons": lambda: rng.choice(reasons),
            "stop_reasons": lambda: rng.choice([None, rng.randint(0, U32_MAX)]),
            "errors": lambda: rng.choice([None, "", "boom 💥 ünïcode"]),
            "logprobs": lambda: None if rng.random() < 0.5 else random_logprobs(rng),
            "prompt_logprobs": lambda: None if rng.random() < 0.7 else random_logprobs(rng),
            "num_cached_tokens": lambda: None if rng.random() < 0.8 else edgy_int(rng, U32_MAX),
            "embeddings": lambda: (
                None
                if rng.random() < 0.8
                else [f32(rng.uniform(-4, 4)) for _ in range(rng.randint(0, 9))]
            ),
        }
        for name, make in optional.items():
            if rng.random() < 0.7:
                cols[name] = [make() for _ in range(n)]
        stats = SchedulerStats(
            num_running=edgy_int(rng, U32_MAX),
            num_waiting=rng.randint(0, 1000),
            kv_cache_usage=f32(rng.random()),
            prefix_cache_queries=edgy_int(rng, U64_MAX),
            prefix_cache_hits=edgy_int(rng, U64_MAX),
            num_preemptions=edgy_int(rng, U64_MAX),
        )
        timestamp = any_float(rng)
        kwargs = {k: v for k, v in cols.items() if k not in ("wire_ids", "new_token_ids")}
        frame = encode_output_batch(
            cols["wire_ids"], cols["new_token_ids"], stats, timestamp, **kwargs
        )

        msg_type, batch = decode_message(frame)
        assert msg_type == _core.MSG_OUTPUT_BATCH
        assert len(batch) == n
        assert batch.wire_ids == cols["wire_ids"]
        assert batch.all_new_token_ids() == cols["new_token_ids"]
        assert [batch.new_token_ids(i) for i in range(n)] == cols["new_token_ids"]
        assert batch.num_new_tokens == [len(t) for t in cols["new_token_ids"]]
        none = [None] * n
        assert batch.finish_reasons == cols.get("finish_reasons", none)
        assert batch.finished_indices == [
            i for i, r in enumerate(cols.get("finish_reasons", none)) if r is not None
        ]
        assert batch.stop_reasons == cols.get("stop_reasons", none)
        assert batch.errors == cols.get("errors", none)
        assert batch.num_cached_tokens == {
            i: v for i, v in enumerate(cols.get("num_cached_tokens", none)) if v is not None
        }
        assert batch.embeddings == {
            i: v for i, v in enumerate(cols.get("embeddings", none)) if v is not None
        }
        for name in ("logprobs", "prompt_logprobs"):
            for i, want in enumerate(cols.get(name, none)):
                got = getattr(batch, name)(i)
                if want is None:
                    assert got is None
                else:
                    assert (got.token_ids, got.logprobs, got.ranks) == want
                    assert got.num_positions == len(want[2])
                    assert got.width == len(want[0]) // len(want[2])
        assert batch.stats == stats
        assert bits(batch.timestamp) == bits(timestamp)
        # A decoded batch re-encodes to the same bytes.
        again = encode_output_batch(
            batch.wire_ids,
            batch.all_new_token_ids(),
            batch.stats,
            batch.timestamp,
            finish_reasons=batch.finish_reasons,
            stop_reasons=batch.stop_reasons,
            errors=batch.errors,
            logprobs=[batch.logprobs(i) for i in range(n)],
            prompt_logprobs=[batch.prompt_logprobs(i) for i in range(n)],
            num_cached_tokens=[batch.num_cached_tokens.get(i) for i in range(n)],
            embeddings=[batch.embeddings.get(i) for i in range(n)],
        )
        assert again == frame


def test_output_batch_accepts_buffers_and_negative_indices() -> None:
    np = pytest.importorskip("numpy")
    ids = np.array([[3, 4, 5], [6, 7, 8]], dtype=np.int64)
    lps = np.array([[-0.5, -1.0, -2.0], [-0.25, -3.0, -4.0]], dtype=np.float32)
    ranks = np.array([1, 2], dtype=np.int32)
    frame = encode_output_batch(
        np.array([7, 8], dtype=np.uint64),
        [np.array([1, 2], dtype=np.int32), (9,)],
        SchedulerStats(),
        0.0,
        logprobs=[(ids, lps, ranks), None],
    )
    _, batch = decode_message(frame)
    assert batch.wire_ids == [7, 8]
    assert batch.new_token_ids(-2) == [1, 2]
    assert batch.new_token_ids(-1) == [9]
    lp = batch.logprobs(0)
    assert lp == Logprobs([3, 4, 5, 6, 7, 8], [-0.5, -1.0, -2.0, -0.25, -3.0, -4.0], [1, 2])
    assert (lp.num_positions, lp.width) == (2, 3)
    with pytest.raises(IndexError):
        batch.new_token_ids(2)
    with pytest.raises(WireError, match=r"new_token_ids\[0\]\[0\]: -1 is not in 0..2\^32"):
        encode_output_batch([1], [np.array([-1], dtype=np.int32)], SchedulerStats(), 0.0)


def test_output_batch_flat_token_ids_give_one_per_request() -> None:
    stats = SchedulerStats()
    nested = encode_output_batch([1, 2, 3], [[7], [8], [9]], stats, 0.0)
    assert encode_output_batch([1, 2, 3], [7, 8, 9], stats, 0.0) == nested
    with pytest.raises(WireError, match=r"new_token_ids: has 2 entries, expected 3"):
        encode_output_batch([1, 2, 3], [7, 8], stats, 0.0)
    with pytest.raises(WireError, match=r"new_token_ids\[1\]: expected an int in 0..2\^32"):
        encode_output_batch([1, 2], [7, [8]], stats, 0.0)  # type: ignore[arg-type]
    np = pytest.importorskip("numpy")
    for dtype in (np.int32, np.int64, np.uint32):
        flat = np.array([7, 8, 9], dtype=dtype)
        assert encode_output_batch(np.array([1, 2, 3]), flat, stats, 0.0) == nested
    with pytest.raises(WireError, match=r"a flat sequence of 6 ids, expected one per wire id"):
        encode_output_batch([1, 2, 3], np.zeros((3, 2), dtype=np.int64), stats, 0.0)


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = 7 if depth >= 3 else 9
    kind = rng.randrange(kinds)
    if kind == 0:
        return None
    if kind == 1:
        return rng.random() < 0.5
    if kind == 2:
        return rng.randint(-(2**63), U64_MAX)
    if kind == 3:
        return any_float(rng)
    if kind == 4:
        return "".join(
            rng.choice(["a", " ", "é", "日本", "👩‍👩‍👧"]) for _ in range(rng.randint(0, 9))
        )
    if kind == 5:
        return rng.randbytes(rng.randint(0, 20))
    if kind == 6:
        return edgy_int(rng, U64_MAX)
    if kind == 7:
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 6))}


def test_utility_messages_round_trip_exactly() -> None:
    rng = random.Random(7)
    for _ in range(300):
        call_id, value = edgy_int(rng, U64_MAX), random_value(rng)
        msg_type, (cid, method, args) = decode_message(encode_utility_call(call_id, "m✓", value))
        assert (msg_type, cid, method) == (_core.MSG_UTILITY_CALL, call_id, "m✓")
        assert same(args, value)
        msg_type, (cid, ok, back) = decode_message(encode_utility_result(call_id, True, value))
        assert (msg_type, cid, ok) == (_core.MSG_UTILITY_RESULT, call_id, True)
        assert same(back, value)
    assert decode_message(encode_utility_result(5, False, "no such method")) == (
        _core.MSG_UTILITY_RESULT,
        (5, False, "no such method"),
    )
    # Tuples travel as lists.
    assert decode_message(encode_utility_call(1, "m", (1, (2,))))[1][2] == [1, [2]]


def test_control_messages_round_trip() -> None:
    ids = [0, 1, 2**32, U64_MAX]
    assert decode_message(encode_abort(ids)) == (_core.MSG_ABORT, ids)
    assert decode_message(encode_abort([])) == (_core.MSG_ABORT, [])
    ready = Ready(
        max_model_len=4096,
        num_kv_blocks=U32_MAX,
        block_size=16,
        vocab_size=1,
        eos_token_ids=[],
        hidden_size=896,
    )
    msg_type, back = decode_message(encode_ready(ready))
    assert msg_type == _core.MSG_READY and back == ready
    assert (back.max_model_len, back.num_kv_blocks, back.eos_token_ids) == (4096, U32_MAX, [])
    assert back.hidden_size == 896
    assert decode_message(encode_engine_error("💥 dead")) == (_core.MSG_ENGINE_ERROR, "💥 dead")
    assert decode_message(encode_shutdown()) == (_core.MSG_SHUTDOWN, None)
    # Any byte buffer decodes, not only bytes.
    frame = encode_abort([9])
    assert decode_message(bytearray(frame)) == decode_message(memoryview(frame))


def test_message_type_constants_are_distinct_bytes() -> None:
    names = [n for n in dir(_core) if n.startswith("MSG_")]
    values = [getattr(_core, n) for n in names]
    assert len(names) == 8 and len(set(values)) == 8
    assert all(0 <= v < 256 for v in values)
    assert _core.DEFAULT_MAX_FRAME_SIZE == 256 * 1024 * 1024


# --- golden fixtures ---


def test_fixture_files_are_up_to_date() -> None:
    for name, data in wire.CASES.items():
        assert (FIXTURES / "wire" / f"{name}.bin").read_bytes() == data, name


def fixture(name: str) -> bytes:
    return (FIXTURES / "wire" / f"{name}.bin").read_bytes()


def test_fixtures_decode_to_their_values() -> None:
    msg_type, requests = decode_message(fixture("add_requests_burst"))
    assert msg_type == _core.MSG_ADD_REQUESTS
    assert [request_dict(r) for r in requests] == [wire.REQUEST_A, wire.REQUEST_B]
    _, [single] = decode_message(fixture("add_request_single"))
    assert request_dict(single) == wire.REQUEST_A
    assert decode_message(fixture("abort")) == (_core.MSG_ABORT, [1, 300, U64_MAX])
    assert decode_message(fixture("utility_call")) == (
        _core.MSG_UTILITY_CALL,
        (7, "reset_prefix_cache", wire.UTILITY_ARGS),
    )
    assert decode_message(fixture("utility_result_ok")) == (
        _core.MSG_UTILITY_RESULT,
        (7, True, [1, 70_000]),
    )
    assert decode_message(fixture("utility_result_error")) == (
        _core.MSG_UTILITY_RESULT,
        (8, False, "no such method: frobnicate"),
    )
    assert decode_message(fixture("ready"))[1] == Ready(
        max_model_len=2048,
        num_kv_blocks=512,
        block_size=16,
        vocab_size=32_000,
        eos_token_ids=[2],
        hidden_size=4096,
    )
    assert decode_message(fixture("engine_error")) == (_core.MSG_ENGINE_ERROR, "CUDA out of memory")
    assert decode_message(fixture("shutdown")) == (_core.MSG_SHUTDOWN, None)

    _, empty = decode_message(fixture("output_batch_empty"))
    assert (len(empty), empty.stats, empty.timestamp) == (0, SchedulerStats(), 0.0)
    _, batch = decode_message(fixture("output_batch"))
    assert batch.wire_ids == [o["wire_id"] for o in wire.OUTPUTS]
    assert batch.all_new_token_ids() == [o["new_token_ids"] for o in wire.OUTPUTS]
    assert batch.finish_reasons == [o.get("finish_reason") for o in wire.OUTPUTS]
    assert batch.stop_reasons == [o.get("stop_reason") for o in wire.OUTPUTS]
    assert batch.errors == [o.get("error") for o in wire.OUTPUTS]
    assert batch.num_cached_tokens == {
        i: o["num_cached_tokens"] for i, o in enumerate(wire.OUTPUTS) if "num_cached_tokens" in o
    }
    assert batch.embeddings == {
        i: o["embedding"] for i, o in enumerate(wire.OUTPUTS) if "embedding" in o
    }
    for i, o in enumerate(wire.OUTPUTS):
        for name in ("logprobs", "prompt_logprobs"):
            got = getattr(batch, name)(i)
            want = o.get(name)
            assert (got is None) == (want is None)
            if got is not None:
                assert (got.num_positions, got.width, got.token_ids, got.logprobs, got.ranks) == (
                    want
                )
    assert batch.stats == SchedulerStats(**wire.STATS)
    assert batch.timestamp == 1_700_000_001.5


def _lp(t: tuple[int, int, list[int], list[float], list[int]] | None) -> Any:
    return None if t is None else (t[2], t[3], t[4])


def test_encoders_write_the_fixture_bytes() -> None:
    a, b = make_request(wire.REQUEST_A), make_request(wire.REQUEST_B)
    assert encode_add_request(a) == fixture("add_request_single")
    assert encode_add_requests([a, b]) == fixture("add_requests_burst")
    assert encode_abort([1, 300, U64_MAX]) == fixture("abort")
    assert encode_utility_call(7, "reset_prefix_cache", wire.UTILITY_ARGS) == fixture(
        "utility_call"
    )
    assert encode_utility_result(7, True, [1, 70_000]) == fixture("utility_result_ok")
    assert encode_utility_result(8, False, "no such method: frobnicate") == fixture(
        "utility_result_error"
    )
    ready = Ready(
        max_model_len=2048,
        num_kv_blocks=512,
        block_size=16,
        vocab_size=32_000,
        eos_token_ids=[2],
        hidden_size=4096,
    )
    assert encode_ready(ready) == fixture("ready")
    assert encode_engine_error("CUDA out of memory") == fixture("engine_error")
    assert encode_shutdown() == fixture("shutdown")
    assert encode_output_batch([], [], SchedulerStats(), 0.0) == fixture("output_batch_empty")
    outs = wire.OUTPUTS
    assert encode_output_batch(
        [o["wire_id"] for o in outs],
        [o["new_token_ids"] for o in outs],
        SchedulerStats(**wire.STATS),
        1_700_000_001.5,
        finish_reasons=[o.get("finish_reason") for o in outs],
        stop_reasons=[o.get("stop_reason") for o in outs],
        errors=[o.get("error") for o in outs],
        logprobs=[_lp(o.get("logprobs")) for o in outs],
        prompt_logprobs=[_lp(o.get("prompt_logprobs")) for o in outs],
        num_cached_tokens=[o.get("num_cached_tokens") for o in outs],
        embeddings=[o.get("embedding") for o in outs],
    ) == fixture("output_batch")


# --- malformed frames: every class raises WireError naming the problem ---

V = wire.WIRE_VERSION


def add_request_frame(**overrides: Any) -> bytes:
    """A one-request AddRequests frame with some fields' wire values replaced."""
    body = wire.add_request_body(wire.REQUEST_A)
    for name, value in overrides.items():
        body[wire.ADD_REQUEST_FIELDS.index(name)] = value
    return wire.frame(wire.MSG_ADD_REQUESTS, [body])


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (b"", "truncated frame: frame header (message type, wire version) needs 2 bytes, 0 left"),
        (
            b"\x01",
            "truncated frame: frame header (message type, wire version) needs 2 bytes, 1 left",
        ),
        (bytes([0x7E, V, 0x90]), "unknown message type 0x7e"),
        (
            bytes([0x04, V + 1, 0x90]),
            f"wrong wire version: frame has {V + 1}, this build speaks {V}",
        ),
        (
            add_request_frame(temperature=1.0),
            "malformed frame: AddRequests[0].temperature: expected float32, found float64 (0xcb)",
        ),
        (
            add_request_frame(prompt_token_ids="abc"),
            "malformed frame: AddRequests[0].prompt_token_ids: expected bin, found str (0xa3)",
        ),
        (
            add_request_frame(priority=2**40),
            "malformed frame: AddRequests[0].priority: int 1099511627776 out of range -2^31..2^31",
        ),
        (
            add_request_frame(wire_id=-1),
            "malformed frame: AddRequests[0].wire_id: int -1 out of range 0..2^64",
        ),
        (
            wire.frame(wire.MSG_ADD_REQUESTS, [wire.add_request_body(wire.REQUEST_A)[:-1]]),
            f"malformed frame: AddRequests[0]: expected an array of {len(wire.ADD_REQUEST)} "
            f"fields, found {len(wire.ADD_REQUEST) - 1}",
        ),
        (
            add_request_frame(prompt_token_ids=b"\x01\x00\x00\x00\x02"),
            "malformed frame: AddRequests[0].prompt_token_ids: array of 4-byte items has 5 bytes, "
            "not a multiple of 4",
        ),
        (
            bytes([wire.MSG_ADD_REQUESTS, V, 0xDD, 0xFF, 0xFF, 0xFF, 0xFF]),
            "truncated frame: AddRequests needs 4294967295 bytes, 0 left",
        ),
        (
            add_request_frame(stop_token_ids=wire.Words([1]))[:-30],
            "truncated frame: AddRequests[0]",
        ),
        (encode_shutdown() + b"\xc0", "malformed frame: 1 trailing bytes after the Shutdown body"),
        (
            bytes([wire.MSG_ENGINE_ERROR, V, 0x91, 0xA2, 0xFF, 0xFE]),
            "malformed frame: EngineError.message: str is not valid UTF-8",
        ),
        (
            wire.frame(wire.MSG_UTILITY_RESULT, [1, False, 3]),
            "malformed frame: UtilityResult.error: expected str, found int (0x03)",
        ),
        (
            wire.frame(wire.MSG_UTILITY_CALL, [1, "m", [[[1]]]])[:-1] + b"\xd4\x01\x00",
            "malformed frame: UtilityCall.args: unsupported msgpack type ext (0xd4)",
        ),
        (
            wire.frame(wire.MSG_UTILITY_CALL, [1, "m", None])[:-1] + b"\x91" * 100 + b"\xc0",
            "malformed frame: UtilityCall.args: lists and maps nest deeper than 64 levels",
        ),
        (
            wire.frame(
                wire.MSG_OUTPUT_BATCH,
                [
                    [[1, wire.Words([]), 9, None, None, None, None, None, None]],
                    wire.stats_body(wire.STATS),
                    0.0,
                ],
            ),
            "malformed frame: OutputBatch.outputs[0].finish_reason: unknown finish reason 9",
        ),
        (
            wire.frame(
                wire.MSG_OUTPUT_BATCH,
                [
                    [
                        [
                            1,
                            wire.Words([]),
                            None,
                            None,
                            None,
                            [2, 3, wire.Words([0] * 6), wire.F32Words([0.0] * 6), wire.Words([0])],
                            None,
                            None,
                            None,
                        ]
                    ],  # noqa: E501
                    wire.stats_body(wire.STATS),
                    0.0,
                ],
            ),
            "malformed frame: OutputBatch.outputs[0].logprobs: 2 positions need 2 ranks, got 1",
        ),
        (
            wire.frame(
                wire.MSG_OUTPUT_BATCH,
                [
                    [[1, wire.Words([]), None, None, None, None, None, -1, None]],
                    wire.stats_body(wire.STATS),
                    0.0,
                ],
            ),
            "malformed frame: OutputBatch.outputs[0].num_cached_tokens: int -1 out of range",
        ),
        (
            wire.frame(
                wire.MSG_OUTPUT_BATCH,
                [
                    [[1, wire.Words([]), 0, None, None, None, None, None, b"\x00" * 6]],
                    wire.stats_body(wire.STATS),
                    0.0,
                ],
            ),
            "malformed frame: OutputBatch.outputs[0].embedding: array of 4-byte items has 6 "
            "bytes, not a multiple of 4",
        ),
        (
            add_request_frame(cache_salt=7),
            "malformed frame: AddRequests[0].cache_salt: expected str, found int",
        ),
        (
            add_request_frame(structured_outputs=["xml", "<a/>"]),
            'malformed frame: AddRequests[0].structured_outputs: kind "xml" is not one of json, '
            "regex, choice, grammar, json_object, after_reasoning",
        ),
        (
            add_request_frame(structured_outputs=["regex", "a" * (1 << 20 | 1)]),
            "malformed frame: AddRequests[0].structured_outputs: spec of 1048577 bytes is over the "
            "limit of 1048576",
        ),
        (
            add_request_frame(logit_bias=[wire.Words([1, 2]), wire.F32Words([0.5])]),
            "malformed frame: AddRequests[0].logit_bias: 2 token ids but 1 biases",
        ),
        (
            add_request_frame(bad_words_token_ids=[wire.Words([1]), b"\x01\x02\x03"]),
            "malformed frame: AddRequests[0].bad_words_token_ids[1]: array of 4-byte items",
        ),
        (
            wire.frame(wire.MSG_OUTPUT_BATCH, [[], [1, 0, 0.5, 0, 0, 0], 0.0]),
            "malformed frame: OutputBatch.stats.kv_cache_usage: expected float32, found float64",
        ),
    ],
)
def test_malformed_frames_raise_wire_error(frame: bytes, message: str) -> None:
    with pytest.raises(WireError) as info:
        decode_message(frame)
    assert str(info.value).startswith(message), str(info.value)
    assert isinstance(info.value, ValueError)


def test_truncated_token_array_names_field_and_sizes() -> None:
    frame = encode_add_request(AddRequest(5, [7] * 1024))
    with pytest.raises(
        WireError,
        match=r"^truncated frame: AddRequests\[0\]\.prompt_token_ids needs 4096 bytes, 30 left$",
    ):
        decode_message(frame[: 2 + 1 + 3 + 1 + 3 + 30])


def test_every_truncation_is_rejected() -> None:
    for frame in [fixture(name) for name in wire.CASES]:
        for cut in range(len(frame)):
            with pytest.raises(WireError):
                decode_message(frame[:cut])


def test_oversized_frames_are_rejected() -> None:
    frame = encode_abort(list(range(100)))
    with pytest.raises(WireError, match=rf"^frame too large: {len(frame)} bytes, the limit is 50$"):
        decode_message(frame, max_frame_size=50)
    with pytest.raises(WireError, match="frame too large"):
        decode_message(bytearray(frame), max_frame_size=50)
    assert decode_message(frame, max_frame_size=len(frame))[1] == list(range(100))


def test_random_and_mutated_frames_never_crash() -> None:
    rng = random.Random(5)
    frames = [fixture(name) for name in wire.CASES]
    decoded = 0
    for i in range(20_000):
        if i % 4 == 0:
            data = bytearray(rng.randbytes(rng.randint(0, 40)))
            if len(data) >= 2:
                data[1] = V
        else:
            data = bytearray(rng.choice(frames))
            for _ in range(rng.randint(1, 3)):
                at = rng.randrange(len(data) + 1)
                op = rng.randrange(4)
                if op == 0 and at < len(data):
                    data[at] ^= 1 << rng.randrange(8)
                elif op == 1:
                    data.insert(at, rng.randrange(256))
                elif op == 2 and at < len(data):
                    del data[at]
                else:
                    data = data[:at]
        try:
            decode_message(bytes(data))
            decoded += 1
        except WireError:
            pass
    assert decoded > 0  # some mutations stay valid (e.g. a changed token id)


def test_non_buffer_frames_are_rejected() -> None:
    with pytest.raises(WireError, match="frame: expected bytes or a byte buffer, got int"):
        decode_message(3)  # type: ignore[arg-type]


# --- encoder argument problems ---


def test_encode_argument_errors_name_the_field() -> None:
    stats = SchedulerStats()
    cases: list[tuple[Any, str]] = [
        (
            lambda: encode_output_batch([1, 2], [[1]], stats, 0.0),
            "cannot encode OutputBatch.new_token_ids: has 1 entries, expected 2 (one per wire id)",
        ),
        (
            lambda: encode_output_batch([1], [[1]], stats, 0.0, finish_reasons=[None, None]),
            "cannot encode OutputBatch.finish_reasons: has 2 entries, expected 1",
        ),
        (
            lambda: encode_output_batch([1], [[1]], stats, 0.0, finish_reasons=["done"]),  # type: ignore[list-item]
            "cannot encode OutputBatch.finish_reasons[0]: expected 'stop', 'length', 'abort' or "
            "'error', got str 'done'",
        ),
        (
            lambda: encode_output_batch([1, 2], [[1], [3, 2**32]], stats, 0.0),
            "cannot encode OutputBatch.new_token_ids[1][1]: expected an int in 0..2^32, got int",
        ),
        (
            lambda: encode_output_batch([-1], [[1]], stats, 0.0),
            "cannot encode OutputBatch.wire_ids[0]: expected an int in 0..2^64, got int -1",
        ),
        (
            lambda: encode_output_batch([1], [["a"]], stats, 0.0),  # type: ignore[arg-type]
            "cannot encode OutputBatch.new_token_ids[0][0]: expected an int in 0..2^32, got str",
        ),
        (
            lambda: encode_output_batch([1], [[1]], stats, 0.0, logprobs=[([1, 2, 3], [0.0], [1])]),
            "cannot encode OutputBatch.logprobs[0]: 1 positions x width 3 needs 3 token ids and "
            "logprobs, got 3 and 1",
        ),
        (
            lambda: encode_output_batch([1], [[1]], stats, 0.0, logprobs=[[1]]),  # type: ignore[list-item]
            "cannot encode OutputBatch.logprobs[0]: expected None, a Logprobs or a "
            "(token_ids, logprobs, ranks) tuple",
        ),
        (
            lambda: encode_utility_call(1, "m", {"a": {1, 2}}),
            "cannot encode UtilityCall.args: expected None, bool, int, float, str, bytes, list, "
            "tuple or dict, got set",
        ),
        (
            lambda: encode_utility_call(1, "m", {1: 2}),
            "cannot encode UtilityCall.args: expected str dict keys, got int 1",
        ),
        (
            lambda: encode_utility_call(1, "m", 2**64),
            "cannot encode UtilityCall.args: expected an int in -2^63..2^64",
        ),
        (
            lambda: encode_utility_result(1, False, 3),
            "cannot encode UtilityResult.error: expected a str, got int 3",
        ),
        (
            lambda: encode_add_requests([AddRequest(1, []), "x"]),  # type: ignore[list-item]
            "cannot encode AddRequests[1]: expected an AddRequest, got str 'x'",
        ),
        (
            lambda: AddRequest(1, [1, True]),
            "cannot encode AddRequest.prompt_token_ids[1]: expected an int in 0..2^32, got bool",
        ),
    ]
    for call, message in cases:
        with pytest.raises(WireError) as info:
            call()
        assert str(info.value).startswith(message), str(info.value)

    deep: Any = None
    for _ in range(65):
        deep = [deep]
    with pytest.raises(WireError, match="nest deeper than 64 levels"):
        encode_utility_call(1, "m", deep)


# --- the GIL is released during the byte work ---


def _count_for(seconds: float) -> int:
    """Iterations of a pure-Python loop in `seconds` of wall time."""
    n = 0
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(100):
            n += 1
    return n


def _share_while(op: Any, window: float = 0.4) -> tuple[float, int]:
    """The counter's progress while `op` loops in another thread, as a fraction of
    its progress alone over the same window; and how many ops ran meanwhile."""
    alone = _count_for(window)
    stop = threading.Event()
    started = threading.Event()
    calls = 0

    def worker() -> None:
        nonlocal calls
        while not stop.is_set():
            started.set()
            op()
            calls += 1

    thread = threading.Thread(target=worker)
    thread.start()
    started.wait()
    together = _count_for(window)
    stop.set()
    thread.join()
    return together / alone, calls


@pytest.fixture
def short_switch_interval() -> Any:
    """A 1 ms switch interval: a thread holding the GIL through a long call then
    starves the counter (it gets ~1 ms per call), while released calls let it run."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.001)
    yield
    sys.setswitchinterval(old)


def test_gil_is_released_during_encode_and_decode(short_switch_interval: None) -> None:
    rng = random.Random(0)
    # 256 requests x 16k tokens: a 16 MiB frame, tens of ms per call.
    requests = [AddRequest(i, [rng.randrange(150_000) for _ in range(16_384)]) for i in range(256)]
    frame = encode_add_requests(requests)
    big_list = [rng.random() for _ in range(1_000_000)]

    def holds_gil() -> None:
        sorted(big_list)  # a long C call that keeps the GIL: the harness's control

    def decode() -> None:
        decode_message(frame)

    def encode() -> None:
        encode_add_requests(requests)

    control = min(_share_while(holds_gil)[0] for _ in range(2))
    assert control < 0.3, f"the harness cannot see a held GIL (control share {control:.0%})"
    for name, op in (("decode", decode), ("encode", encode)):
        # Shared machines are noisy: up to five trials, the best one counts.
        best = 0.0
        for _ in range(5):
            share, calls = _share_while(op)
            assert calls > 0
            best = max(best, share)
            if best >= 0.3:
                break
        assert best >= 0.3, f"the counter got {best:.0%} of its solo progress during {name}"
