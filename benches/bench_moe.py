"""Mixture-of-experts MLP: the grouped expert path (`asyncllm.models.moe`: pairs
sorted by expert, then either every expert padded to the busiest in two batched
matmuls or one matmul pair per active expert, as the loads choose; both forced
ways shown too) against a per-token loop and against computing every expert for
every token.

    python benches/bench_moe.py [--tokens 1 4 16 64 256] [--repeats 15] [--quick]

Mixtral-style shapes scaled down: hidden 512, 8 experts of intermediate 1024, top 2.
Runs are interleaved (grouped, per-token, all, grouped, ...) so a shared machine's
noise hits all three alike; medians in ms per layer call.
"""

from __future__ import annotations

import argparse
import functools
import time

import numpy as np
import torch
import torch.nn.functional as F

from asyncllm.models.moe import grouped_experts, reference_experts, route

HIDDEN, INTER, EXPERTS, TOP_K = 512, 1024, 8, 2


def every_expert(x, weights, ids, gate_up, down):  # noqa: ANN001, ANN201 - bench helper
    """Every expert over every token, then each token keeps its top k."""
    gate, up = torch.einsum("th,eih->eti", x, gate_up).split(INTER, dim=-1)
    out = torch.einsum("eti,ehi->eth", F.silu(gate) * up, down)  # [E, T, H]
    picked = out.permute(1, 0, 2).gather(1, ids[..., None].expand(-1, -1, HIDDEN))
    return (picked * weights[..., None]).sum(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="16 tokens, 2 repeats")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.repeats = [16], 2
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.02
    router = torch.randn(EXPERTS, HIDDEN, generator=g)
    print(
        f"threads={torch.get_num_threads()}  hidden={HIDDEN} experts={EXPERTS}x{INTER} top{TOP_K}"
    )
    print(
        f"{'tokens':>6} {'grouped':>8} {'padded':>8} {'loop':>8} {'per-token':>9} {'every':>8} "
        f"{'loop/grp':>8} {'tok/grp':>7} {'all/grp':>7}"
    )
    for n in args.tokens:
        x = torch.randn(n, HIDDEN, generator=g)
        weights, ids = route(x @ router.T, TOP_K, renormalize=True)
        fns = [
            grouped_experts,
            functools.partial(grouped_experts, padded=True),
            functools.partial(grouped_experts, padded=False),
            reference_experts,
            every_expert,
        ]
        times: list[list[float]] = [[] for _ in fns]
        with torch.inference_mode():
            for fn in fns:
                fn(x, weights, ids, gate_up, down)
            for _ in range(args.repeats):
                for i, fn in enumerate(fns):
                    t0 = time.perf_counter()
                    fn(x, weights, ids, gate_up, down)
                    times[i].append(time.perf_counter() - t0)
        grouped, padded, loop, per_token, every = (float(np.median(t)) * 1e3 for t in times)
        print(
            f"{n:>6} {grouped:8.3f} {padded:8.3f} {loop:8.3f} {per_token:9.3f} {every:8.3f} "
            f"{loop / grouped:8.2f} {per_token / grouped:7.2f} {every / grouped:7.2f}"
        )


if __name__ == "__main__":
    main()
