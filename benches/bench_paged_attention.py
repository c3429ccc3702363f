"""Decode attention at batch 256: asyncllm's paged op vs SDPA on a contiguous cache.

Usage: python benches/bench_paged_attention.py [--threads N] [--repeats R] [--quick]
Three ways to attend one decode step's queries over their contexts (ragged, ±10 %
around ctx): `rust` is `paged_attention` on the Rust kernel (K/V read in place
through the block tables), `torch` the same call on the torch path (gather, then
SDPA), `contig` SDPA on a contiguous [B, Hkv, L, D] cache at the mean length (the
floor a non-paged engine gets). Each includes writing the step's new k/v. Runs are
interleaved (rust, torch, contig, rust, ...) so that the noise of a shared machine
hits all three alike; medians in ms per layer call, ratios to contig.

`--window W` instead times the sliding-window decode (`window=W`) at contexts W,
2W and 4W, on the Rust kernel beside the same call without a window, and on the
torch path (which gathers each decode's window blocks only): windowed time stays
flat in the context, full attention grows with it.

The kernel runs on torch's OpenMP team; `ASYNCLLM_KERNEL_POOL=rayon` runs it on a
rayon pool of its own instead (read once per process: to compare the two, alternate
processes, as the runs in benches/history/ do).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.models import attention

# name: (heads, kv heads, head_dim)
CONFIGS = {"micro": (4, 2, 32), "small": (8, 4, 64)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="micro at ctx 100, 2 repeats")
    parser.add_argument("--window", type=int, help="sliding window: contexts W, 2W, 4W")
    args = parser.parse_args()
    if args.window:
        torch.set_num_threads(args.threads)
        bench_window(args.window, 2 if args.quick else args.repeats, args.threads)
        return
    configs, contexts = CONFIGS, (100, 300)
    if args.quick:
        configs, contexts, args.repeats = {"micro": CONFIGS["micro"]}, (100,), 2
    torch.set_num_threads(args.threads)
    print(f"threads={args.threads}  batch=256  block_size=16  (ms per layer call, median)")
    print(
        f"{'model':6} {'ctx':>4} {'rust':>7} {'torch':>7} {'contig':>7} "
        f"{'rust/contig':>11} {'torch/contig':>12}"
    )
    for name, (heads, kv_heads, head_dim) in configs.items():
        for ctx in contexts:
            rust, torch_path, contig = bench(heads, kv_heads, head_dim, ctx, args.repeats)
            print(
                f"{name:6} {ctx:>4} {rust:7.2f} {torch_path:7.2f} {contig:7.2f} "
                f"{rust / contig:11.2f} {torch_path / contig:12.2f}"
            )


def bench_window(window: int, repeats: int, threads: int) -> None:
    heads, kv_heads, head_dim = CONFIGS["small"]
    print(f"threads={threads}  batch=256  block_size=16  small  window={window}")
    print(
        f"{'ctx':>6} {'windowed ms':>11} {'full ms':>8} {'windowed/full':>13} "
        f"{'torch windowed ms':>17}"
    )
    for ctx in (window, 2 * window, 4 * window):
        windowed, torch_windowed = bench(
            heads, kv_heads, head_dim, ctx, repeats, window, paths=("rust", "torch")
        )
        full = bench(heads, kv_heads, head_dim, ctx, repeats, paths=("rust",))[0]
        print(
            f"{ctx:>6} {windowed:11.2f} {full:8.2f} {windowed / full:13.2f} {torch_windowed:17.2f}"
        )


def bench(
    heads: int,
    kv_heads: int,
    head_dim: int,
    ctx: int,
    repeats: int,
    window: int | None = None,
    paths: tuple[str, ...] = ("rust", "torch", "contig"),
) -> list[float]:
    batch, block_size = 256, 16
    rng = np.random.default_rng(0)
    ctxs = rng.integers(int(ctx * 0.9), int(ctx * 1.1) + 1, batch)  # the step's contexts
    blocks_per_seq = -(-(ctxs + 1) // block_size)
    num_blocks = int(blocks_per_seq.sum()) + 16
    width = max(64, int(blocks_per_seq.max()))
    perm, tables, start = rng.permutation(num_blocks), np.zeros((batch, width), np.int32), 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[start : start + n]
        start += n
    slots = tables[np.arange(batch), ctxs // block_size] * block_size + ctxs % block_size
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim)
    meta = attention.build_attention_metadata(
        np.ones(batch, np.int32),
        ctxs.astype(np.int32),
        tables,
        slots.astype(np.int64),
        block_size,
        torch.device("cpu"),
    )
    q = torch.randn(batch, heads, head_dim)
    k, v = torch.randn(batch, kv_heads, head_dim), torch.randn(batch, kv_heads, head_dim)
    scale = head_dim**-0.5

    # The floor: a contiguous [B, Hkv, Lmax, D] cache at the mean length, appended in place.
    length = int(ctxs.mean()) + 1
    k_cont = torch.randn(batch, kv_heads, length + 32, head_dim)
    v_cont = torch.randn(batch, kv_heads, length + 32, head_dim)
    q_grouped = q.view(batch, kv_heads, heads // kv_heads, head_dim)

    def contiguous() -> None:
        k_cont[:, :, length - 1] = k
        v_cont[:, :, length - 1] = v
        F.scaled_dot_product_attention(
            q_grouped, k_cont[:, :, :length], v_cont[:, :, :length], scale=scale
        )

    def paged_rust() -> None:
        assert attention.can_use_native_decode(q, cache)
        attention.paged_attention(q, k, v, cache, meta, scale, window=window)

    def paged_torch() -> None:
        saved = attention.can_use_native_decode
        attention.can_use_native_decode = lambda q, kv_cache: False  # type: ignore[assignment]
        try:
            attention.paged_attention(q, k, v, cache, meta, scale, window=window)
        finally:
            attention.can_use_native_decode = saved  # type: ignore[assignment]

    by_name = {"rust": paged_rust, "torch": paged_torch, "contig": contiguous}
    fns: list[Callable[[], None]] = [by_name[name] for name in paths]
    times: list[list[float]] = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return [float(np.median(t)) * 1e3 for t in times]


if __name__ == "__main__":
    main()
