"""Wire codec through the Python API vs msgspec and pickle, on the same data.

    python benches/bench_codec.py [--reps 7] [--window 0.2] [--quick]

Cases: a 256-request output batch with one new token each (4 of them finished),
the same with top-5 logprobs, and a burst of 256 AddRequests with 512-token
prompts. For each: encode, decode, and decode + access (every field turned into
Python objects, as a consumer would: msgspec and pickle build them while decoding,
the asyncllm view builds them on access).

Competitors: asyncllm `_core` (columns in, `bytes` out; a lazy `OutputBatch` view;
variants: new token ids passed flat, one per request, and logprobs passed as
tuples of lists instead of prebuilt `Logprobs`);
msgspec typed Structs (`array_like=True, omit_defaults=True, gc=False`, as vLLM's
engine messages) with token lists as lists of ints, and a variant with token and
logprob arrays as raw bytes (`array` to/from lists included in build/access);
pickle (protocol 5) of plain tuples. Inputs are built before timing: encode times
start from ready columns / Structs / tuples.

Reported: median microseconds per operation over `--reps` repetitions and the
ratio to msgspec (lists) measured in the same run. msgspec and pickle hold the GIL
for their whole time. asyncllm holds it only to extract arguments and to wrap the
result; the "GIL held" table measures those parts directly, in this process:

- encode: the same call made to fail on the last entry of the last column it
  extracts (so every argument has been extracted, nothing encoded; includes
  raising the error), plus copying a frame of that size into a new `bytes`;
- decode: decoding a frame of the same message with nothing in its arrays (the
  view is lazy, so wrapping costs the same for any batch); for AddRequests, 256
  requests with empty prompts (one object per request is built either way).

That the byte work itself runs without the GIL is asserted by tests/test_codec.py.
"""

from __future__ import annotations

import argparse
import pickle
import random
import statistics
import sys
import time
from array import array
from collections.abc import Callable
from typing import Any

import msgspec

from asyncllm import _core

NUM_REQUESTS = 256
PROMPT_LEN = 512
TOP_N = 5


# --- msgspec schema, shaped like vLLM's EngineCoreOutputs ---


class MsLogprobs(msgspec.Struct, array_like=True, gc=False):
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


class MsOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    wire_id: int
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    logprobs: MsLogprobs | None = None
    prompt_logprobs: MsLogprobs | None = None


class MsStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int


class MsBatch(msgspec.Struct, array_like=True, gc=False):
    outputs: list[MsOutput]
    stats: MsStats
    timestamp: float


class MsLogprobsB(msgspec.Struct, array_like=True, gc=False):
    token_ids: bytes
    logprobs: bytes
    ranks: bytes


class MsOutputB(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    wire_id: int
    new_token_ids: bytes
    finish_reason: str | None = None
    stop_reason: int | None = None
    error: str | None = None
    logprobs: MsLogprobsB | None = None
    prompt_logprobs: MsLogprobsB | None = None


class MsBatchB(msgspec.Struct, array_like=True, gc=False):
    outputs: list[MsOutputB]
    stats: MsStats
    timestamp: float


class MsRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    wire_id: int
    prompt_token_ids: list[int]
    arrival_time: float
    priority: int
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop_token_ids: list[int]
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


class MsRequestBytes(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The bytes variant: token arrays as raw little-endian u32."""

    wire_id: int
    prompt_token_ids: bytes
    arrival_time: float
    priority: int
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    stop_token_ids: bytes
    ignore_eos: bool
    logprobs: int | None
    prompt_logprobs: int | None
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float


STATS = {
    "num_running": 256,
    "num_waiting": 12,
    "kv_cache_usage": 0.625,
    "prefix_cache_queries": 10_000,
    "prefix_cache_hits": 4_000,
    "num_preemptions": 3,
}


def u32_bytes(values: list[int]) -> bytes:
    return array("I", values).tobytes()


def f32_bytes(values: list[float]) -> bytes:
    return array("f", values).tobytes()


def from_u32(raw: bytes) -> list[int]:
    a = array("I")
    a.frombytes(raw)
    return a.tolist()


def from_f32(raw: bytes) -> list[float]:
    a = array("f")
    a.frombytes(raw)
    return a.tolist()


class Case:
    """One data set and the encode/decode/access operations of each competitor,
    and the probes that time asyncllm's GIL-held parts (see the module doc)."""

    def __init__(self, name: str, ops: dict[str, dict[str, Callable[[], Any]]]) -> None:
        self.name = name
        self.ops = ops
        self.sizes: dict[str, int] = {}
        self.gil_probes: dict[str, Callable[[], Any]] = {}


def failing(call: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        try:
            call()
        except _core.WireError:
            return
        raise AssertionError("the probe was meant to fail")

    return run


def copy_probe(size: int) -> Callable[[], Any]:
    """Copying `size` bytes into a new bytes object, as the encoders do."""
    source = bytearray(size)
    return lambda: bytes(source)


def output_batch_case(rng: random.Random, with_logprobs: bool) -> Case:
    n = NUM_REQUESTS
    wire_ids = list(range(1000, 1000 + n))
    tokens = [[rng.randrange(128_000)] for _ in range(n)]
    finish = ["length" if i % 64 == 0 else None for i in range(n)]
    lps: list[Any] = [None] * n
    if with_logprobs:
        lps = [
            (
                [t[0]] + [rng.randrange(128_000) for _ in range(TOP_N)],
                [-0.25 * k for k in range(TOP_N + 1)],
                [1],
            )
            for t in tokens
        ]
    stats = _core.SchedulerStats(**STATS)
    ts = 1_700_000_000.5

    # asyncllm: logprobs as `Logprobs` objects, built beforehand like msgspec's
    # Structs (the engine's sampler builds them); the tuple form is a variant.
    kwargs: dict[str, Any] = {"finish_reasons": finish}
    kwargs_tuples = dict(kwargs)
    if with_logprobs:
        kwargs["logprobs"] = [None if lp is None else _core.Logprobs(*lp) for lp in lps]
        kwargs_tuples["logprobs"] = lps

    def ours_encode() -> bytes:
        return _core.encode_output_batch(wire_ids, tokens, stats, ts, **kwargs)

    frame = ours_encode()

    def ours_encode_tuples() -> bytes:
        return _core.encode_output_batch(wire_ids, tokens, stats, ts, **kwargs_tuples)

    flat_tokens = [t[0] for t in tokens]  # one new token per request: the flat form

    def ours_encode_flat() -> bytes:
        return _core.encode_output_batch(wire_ids, flat_tokens, stats, ts, **kwargs)

    def ours_decode() -> Any:
        return _core.decode_message(frame)

    def ours_access() -> Any:
        _, b = _core.decode_message(frame)
        out = [b.wire_ids, b.all_new_token_ids(), b.finish_reasons, b.stop_reasons, b.stats]
        if with_logprobs:
            lps = [b.logprobs(i) for i in range(len(b))]
            out.append([(lp.token_ids, lp.logprobs, lp.ranks) for lp in lps])
        return out

    # msgspec, lists
    ms_batch = MsBatch(
        [
            MsOutput(w, t, f, logprobs=None if lp is None else MsLogprobs(*lp))
            for w, t, f, lp in zip(wire_ids, tokens, finish, lps, strict=True)
        ],
        MsStats(**STATS),
        ts,
    )
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(MsBatch)
    ms_frame = enc.encode(ms_batch)

    # msgspec, bytes
    ms_batch_b = MsBatchB(
        [
            MsOutputB(
                w,
                u32_bytes(t),
                f,
                logprobs=None
                if lp is None
                else MsLogprobsB(u32_bytes(lp[0]), f32_bytes(lp[1]), u32_bytes(lp[2])),
            )
            for w, t, f, lp in zip(wire_ids, tokens, finish, lps, strict=True)
        ],
        MsStats(**STATS),
        ts,
    )
    dec_b = msgspec.msgpack.Decoder(MsBatchB)
    ms_frame_b = enc.encode(ms_batch_b)

    def ms_b_access() -> Any:
        b = dec_b.decode(ms_frame_b)
        out: list[Any] = [
            (o.wire_id, from_u32(o.new_token_ids), o.finish_reason) for o in b.outputs
        ]
        if with_logprobs:
            lps = [o.logprobs for o in b.outputs]
            out.append(
                [(from_u32(x.token_ids), from_f32(x.logprobs), from_u32(x.ranks)) for x in lps]
            )
        return out

    # pickle of plain tuples
    plain = (
        [
            (w, t, f, None, None, lp, None)
            for w, t, f, lp in zip(wire_ids, tokens, finish, lps, strict=True)
        ],
        tuple(STATS.values()),
        ts,
    )
    pk_frame = pickle.dumps(plain, protocol=5)

    ops = {
        "asyncllm": {"encode": ours_encode, "decode": ours_decode, "decode+access": ours_access},
        "asyncllm (tuples)": {
            "encode": ours_encode_tuples,
            "decode": ours_decode,
            "decode+access": ours_access,
        },
        "asyncllm (flat ids)": {
            "encode": ours_encode_flat,
            "decode": ours_decode,
            "decode+access": ours_access,
        },
        "msgspec": {
            "encode": lambda: enc.encode(ms_batch),
            "decode": lambda: dec.decode(ms_frame),
            "decode+access": lambda: dec.decode(ms_frame),
        },
        "msgspec-bytes": {
            "encode": lambda: enc.encode(ms_batch_b),
            "decode": lambda: dec_b.decode(ms_frame_b),
            "decode+access": ms_b_access,
        },
        "pickle": {
            "encode": lambda: pickle.dumps(plain, protocol=5),
            "decode": lambda: pickle.loads(pk_frame),
            "decode+access": lambda: pickle.loads(pk_frame),
        },
    }
    sizes = {"asyncllm": len(frame), "msgspec": len(ms_frame), "msgspec-bytes": len(ms_frame_b)}
    sizes["asyncllm (tuples)"] = sizes["asyncllm (flat ids)"] = len(frame)
    assert ours_encode_flat() == frame
    del ops["asyncllm (flat ids)" if with_logprobs else "asyncllm (tuples)"]
    sizes["pickle"] = len(pk_frame)
    name = f"output batch 256x1{' + top-5 logprobs' if with_logprobs else ''}"
    case = Case(name, ops)
    case.sizes = sizes

    # The last column extracted is prompt_logprobs: its last entry is invalid.
    bad_last = dict(kwargs, prompt_logprobs=[None] * (n - 1) + ["bad"])
    case.gil_probes["encode: extract"] = failing(
        lambda: _core.encode_output_batch(wire_ids, tokens, stats, ts, **bad_last)
    )
    if not with_logprobs:
        case.gil_probes["encode: extract (flat ids)"] = failing(
            lambda: _core.encode_output_batch(wire_ids, flat_tokens, stats, ts, **bad_last)
        )
    case.gil_probes["encode: copy into bytes"] = copy_probe(len(frame))
    empty = _core.encode_output_batch([], [], stats, ts)
    case.gil_probes["decode: wrap"] = lambda: _core.decode_message(empty)
    return case


def add_requests_case(rng: random.Random) -> Case:
    prompts = [[rng.randrange(128_000) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    fields = {
        "arrival_time": 1_700_000_000.25,
        "priority": 0,
        "max_tokens": 128,
        "min_tokens": 0,
        "temperature": 0.75,
        "top_p": 0.875,
        "top_k": 0,
        "min_p": 0.0,
        "stop_token_ids": [2, 128_009],
        "ignore_eos": False,
        "logprobs": None,
        "prompt_logprobs": None,
        "repetition_penalty": 1.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }
    ours = [_core.AddRequest(i, p, seed=i, **fields) for i, p in enumerate(prompts)]
    frame = _core.encode_add_requests(ours)

    def ours_access() -> Any:
        _, reqs = _core.decode_message(frame)
        return [(r.wire_id, r.prompt_token_ids, r.temperature, r.stop_token_ids) for r in reqs]

    ms_reqs = [
        MsRequest(wire_id=i, prompt_token_ids=p, seed=i, **fields) for i, p in enumerate(prompts)
    ]
    enc = msgspec.msgpack.Encoder()
    dec = msgspec.msgpack.Decoder(list[MsRequest])
    ms_frame = enc.encode(ms_reqs)

    stop_bytes = u32_bytes(fields["stop_token_ids"])
    bytes_fields = dict(fields, stop_token_ids=stop_bytes)
    ms_reqs_b = [
        MsRequestBytes(wire_id=i, prompt_token_ids=u32_bytes(p), seed=i, **bytes_fields)
        for i, p in enumerate(prompts)
    ]
    dec_b = msgspec.msgpack.Decoder(list[MsRequestBytes])
    ms_frame_b = enc.encode(ms_reqs_b)

    def ms_b_access() -> Any:
        reqs = dec_b.decode(ms_frame_b)
        return [
            (r.wire_id, from_u32(r.prompt_token_ids), r.temperature, from_u32(r.stop_token_ids))
            for r in reqs
        ]

    plain = [tuple(msgspec.structs.astuple(r)) for r in ms_reqs]
    pk_frame = pickle.dumps(plain, protocol=5)
    ops = {
        "asyncllm": {
            "encode": lambda: _core.encode_add_requests(ours),
            "decode": lambda: _core.decode_message(frame),
            "decode+access": ours_access,
        },
        "msgspec": {
            "encode": lambda: enc.encode(ms_reqs),
            "decode": lambda: dec.decode(ms_frame),
            "decode+access": lambda: dec.decode(ms_frame),
        },
        "msgspec-bytes": {
            "encode": lambda: enc.encode(ms_reqs_b),
            "decode": lambda: dec_b.decode(ms_frame_b),
            "decode+access": ms_b_access,
        },
        "pickle": {
            "encode": lambda: pickle.dumps(plain, protocol=5),
            "decode": lambda: pickle.loads(pk_frame),
            "decode+access": lambda: pickle.loads(pk_frame),
        },
    }
    case = Case("AddRequests burst 256x512", ops)
    case.sizes = {
        "asyncllm": len(frame),
        "msgspec": len(ms_frame),
        "msgspec-bytes": len(ms_frame_b),
        "pickle": len(pk_frame),
    }
    case.gil_probes["encode: extract"] = failing(lambda: _core.encode_add_requests([*ours, None]))
    case.gil_probes["encode: copy into bytes"] = copy_probe(len(frame))
    hollow = _core.encode_add_requests([_core.AddRequest(i, []) for i in range(NUM_REQUESTS)])
    case.gil_probes["decode: wrap"] = lambda: _core.decode_message(hollow)
    return case


def median_us(op: Callable[[], Any], reps: int, target_s: float = 0.2) -> float:
    """Median over `reps` repetitions of the mean time per call, in microseconds."""
    op()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < 0.02:
        op()
        n += 1
    per = (time.perf_counter() - t0) / n
    number = max(1, int(target_s / per))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(number):
            op()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--window", type=float, default=0.2, help="seconds per repetition")
    parser.add_argument("--quick", action="store_true", help="1 rep of 10 ms: checks that it runs")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.window = 1, 0.01
    rng = random.Random(0)
    cases = [
        output_batch_case(rng, with_logprobs=False),
        output_batch_case(rng, with_logprobs=True),
        add_requests_case(rng),
    ]
    print(f"python {sys.version.split()[0]}, msgspec {msgspec.__version__}, reps {args.reps}")
    for case in cases:
        print(f"\n### {case.name}\n")
        print("| op | impl | median µs | vs msgspec | frame bytes |")
        print("|---|---|---:|---:|---:|")
        for op_name in ("encode", "decode", "decode+access"):
            base = median_us(case.ops["msgspec"][op_name], args.reps, args.window)
            for impl, ops in case.ops.items():
                t = base if impl == "msgspec" else median_us(ops[op_name], args.reps, args.window)
                size = case.sizes[impl]
                print(f"| {op_name} | {impl} | {t:.1f} | {t / base:.2f} | {size} |")
        print("\n| asyncllm, GIL held | median µs |")
        print("|---|---:|")
        for probe_name, probe in case.gil_probes.items():
            print(f"| {probe_name} | {median_us(probe, args.reps, args.window):.1f} |")


if __name__ == "__main__":
    main()
