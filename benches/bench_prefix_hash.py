"""Prefix-cache key hashing per 256-request step: the old chain of Python's `hash()`
(64 bits, not collision resistant: reproduced here as the baseline), the same
SHA-256 chain as the engine's computed with Python's `hashlib`, and the engine's
own (`Request.hash_full_blocks`, one native call per request: rust/prefix_hash.rs).

- decode: 256 running requests whose lengths are staggered so that 256 / block_size
  of them fill a block each step, as in a steady decode batch; timed is what
  `Scheduler.update_from_output` calls for them (`hash_full_blocks`), per step.
- prefill: hashing the prompts of 256 requests of ~512 tokens (what `make_request`
  does for a burst of new requests), per burst.

Each run times every variant on the same requests, interleaved; reported are the
medians over runs of each variant's median per step, and of the per-run ratios.

    python benches/bench_prefix_hash.py [--runs 7] [--block-size 16] [--quick]
"""

from __future__ import annotations

import argparse
import hashlib
import random
import statistics
import struct
import sys
import time
from collections.abc import Callable

from asyncllm.core.request import Request
from asyncllm.sampling_params import SamplingParams

NUM_REQUESTS = 256
DOMAIN = b"asyncllm prefix-cache block v1\0"


class OldHashRequest(Request):
    """The engine before this change: keys chain Python's `hash()`."""

    __slots__ = ()

    def hash_full_blocks(self) -> None:
        hashes = self.block_hashes
        if hashes is None:
            return
        size = self.block_size
        tokens = self.all_token_ids
        parent = hash(hashes[-1]) if hashes else 0
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            key = (parent, tuple(tokens[start : start + size]))
            hashes.append(key)  # type: ignore[arg-type]
            parent = hash(key)


class HashlibRequest(Request):
    """The engine's SHA-256 chain (same keys), computed with Python's hashlib."""

    __slots__ = ()

    def hash_full_blocks(self) -> None:
        hashes = self.block_hashes
        if hashes is None:
            return
        size = self.block_size
        tokens = self.all_token_ids
        if hashes:
            parent = hashes[-1]
        else:
            salt = self.sampling_params.cache_salt
            root = DOMAIN + (b"\0" if salt is None else b"\1" + salt.encode())
            parent = hashlib.sha256(root).digest()
        pack = struct.Struct(f"<{size}I").pack
        sha256 = hashlib.sha256
        for start in range(len(hashes) * size, len(tokens) - size + 1, size):
            parent = sha256(parent + pack(*tokens[start : start + size])).digest()
            hashes.append(parent)


VARIANTS: dict[str, type[Request]] = {
    "hash() chain (before)": OldHashRequest,
    "hashlib SHA-256": HashlibRequest,
    "Rust SHA-256 (after)": Request,
}


def prompts(num: int, length: int, block_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # staggered lengths: request i fills a block at step (block_size - i) % block_size
    return [[rng.randrange(150_000) for _ in range(length + i % block_size)] for i in range(num)]


def make(cls: type[Request], rid: int, prompt: list[int], block_size: int, hashed: bool) -> Request:
    return cls(
        rid,
        list(prompt),
        SamplingParams(max_tokens=None, ignore_eos=True),
        eos_token_ids=(),
        max_model_len=1 << 20,
        block_size=block_size,
        hash_blocks=hashed,
    )


def time_decode(
    cls: type[Request], batch: list[list[int]], block_size: int, steps: int, seed: int
) -> float:
    """Median seconds per decode step spent hashing the blocks that step filled."""
    requests = [make(cls, i, p, block_size, True) for i, p in enumerate(batch)]
    rng = random.Random(seed)
    per_step = []
    for _ in range(steps):
        filled = []
        token = rng.randrange(150_000)
        for r in requests:
            r.all_token_ids.append(token)
            if not len(r.all_token_ids) % block_size:
                filled.append(r)
        t0 = time.perf_counter()
        for r in filled:
            r.hash_full_blocks()
        per_step.append(time.perf_counter() - t0)
    return statistics.median(per_step)


def time_prefill(cls: type[Request], batch: list[list[int]], block_size: int, reps: int) -> float:
    """Median seconds to hash every prompt of the batch (one burst of new requests)."""
    per_burst = []
    for _ in range(reps):
        requests = [make(cls, i, p, block_size, False) for i, p in enumerate(batch)]
        for r in requests:
            r.block_hashes = []
        t0 = time.perf_counter()
        for r in requests:
            r.hash_full_blocks()
        per_burst.append(time.perf_counter() - t0)
    return statistics.median(per_burst)


def check_same_keys(batch: list[list[int]], block_size: int) -> None:
    for p in batch[:8]:
        ours = make(Request, 0, p, block_size, True).block_hashes
        theirs = make(HashlibRequest, 0, p, block_size, True).block_hashes
        if ours != theirs:
            sys.exit("hashlib and Rust keys differ: the benchmark compares different things")


def report(
    title: str, unit: str, scale: float, runs: list[dict[str, float]], baseline: str
) -> None:
    print(f"\n{title}")
    print(f"| variant | median {unit} | vs before (median of per-run ratios) |")
    print("|---|---:|---:|")
    for name in VARIANTS:
        values = [r[name] for r in runs]
        ratio = statistics.median(r[name] / r[baseline] for r in runs)
        print(f"| {name} | {scale * statistics.median(values):.1f} | {ratio:.2f}x |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per run")
    ap.add_argument("--quick", action="store_true", help="smallest settings (CI smoke run)")
    args = ap.parse_args(argv)
    if args.quick:
        args.runs, args.steps, args.prompt_len = 1, 4, 64
    bs = args.block_size
    batch = prompts(NUM_REQUESTS, args.prompt_len, bs, seed=0)
    check_same_keys(batch, bs)
    print(
        f"{NUM_REQUESTS} requests, block_size {bs}, prompts of {args.prompt_len}"
        f"..{args.prompt_len + bs - 1} tokens, {args.runs} runs, python {sys.version.split()[0]}"
    )
    decode_runs: list[dict[str, float]] = []
    prefill_runs: list[dict[str, float]] = []
    timers: dict[str, Callable[[type[Request]], float]] = {
        "decode": lambda cls: time_decode(cls, batch, bs, args.steps, seed=1),
        "prefill": lambda cls: time_prefill(cls, batch, bs, reps=3),
    }
    for run in range(args.runs):
        order = list(VARIANTS.items())
        if run % 2:
            order.reverse()  # alternate who goes first, so warm-up favours no one
        decode_runs.append({name: timers["decode"](cls) for name, cls in order})
        prefill_runs.append({name: timers["prefill"](cls) for name, cls in order})
    base = "hash() chain (before)"
    report(
        f"decode step: {NUM_REQUESTS // bs} blocks filled of {NUM_REQUESTS} requests",
        "µs / step",
        1e6,
        decode_runs,
        base,
    )
    num_blocks = sum(len(p) // bs for p in batch)
    report(
        f"prefill burst: {NUM_REQUESTS} prompts, {num_blocks} blocks",
        "ms / burst",
        1e3,
        prefill_runs,
        base,
    )


if __name__ == "__main__":
    main()
