"""Memory-bound matrix-vector products: each linear kernel's weight-read rate at one to
a few rows against the machine's DRAM read bandwidth, for weights far larger than the
caches.

    python benches/bench_gemv.py [--shape 5632x2048] [--rows 1 4] [--dtypes float32 bfloat16]
        [--rounds 5] [--quick]

The weights are a ring of matrices of `--shape` ([out, in]) totalling 4x the
last-level cache (at least 1 GiB), visited in turn as a decode step visits its layers,
so every call reads its weight from memory. Per kernel (torch's F.linear, the prepacked
oneDNN linear, the extension's rust kernel) and row count: bytes of weights read per
second, the median of `--rounds` passes over the ring, the kernels alternating pass by
pass; and the extension's vector sum over the same bytes (the machine's read
bandwidth) in the same loop. "of bw" is kernel rate / bandwidth: the issue's target
is >= 0.80.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_roofline import llc_bytes, machine_header  # noqa: E402
from models import QUICK_HELP  # noqa: E402

from asyncllm import _core  # noqa: E402
from asyncllm.models.linear_kernels import (  # noqa: E402
    onednn_available,
    pack_onednn,
    run_onednn,
    run_rust,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="5632x2048", help="OUTxIN of each weight")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 4])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    total = max(1 << 30, 4 * llc_bytes())
    if args.quick:
        args.shape, args.rows, args.dtypes, args.rounds, total = (
            "256x128",
            [1],
            ["float32"],
            1,
            8 << 20,
        )
    n, k = (int(v) for v in args.shape.split("x"))
    threads = torch.get_num_threads()
    print(machine_header())
    print(
        f"weights: a ring of {args.shape} matrices, {total >> 20} MiB per dtype; {threads} threads"
    )
    print("\n| dtype | rows | kernel | GB/s | of bw | read bw GB/s |")
    print("|---|---:|---|---:|---:|---:|")
    for dtype in args.dtypes:
        tdtype = getattr(torch, dtype)
        size = n * k * torch.empty((), dtype=tdtype).element_size()
        ring = [torch.randn(n, k, dtype=tdtype) for _ in range(max(2, total // size))]
        packed = [pack_onednn(w) for w in ring] if onednn_available(tdtype) else []
        flat = torch.ones(len(ring) * size // 4).numpy()
        for rows in args.rows:
            x = torch.randn(rows, k, dtype=tdtype)
            kernels = {
                "torch": lambda w, i, x=x: F.linear(x, w),
                "rust": lambda w, i, x=x: run_rust(x, w, None, threads),
            }
            if packed:
                kernels["onednn"] = lambda w, i, x=x, p=packed: run_onednn(x, p[i], None)
            rates: dict[str, list[float]] = {name: [] for name in kernels}
            bws = []
            with torch.inference_mode():
                for fn in kernels.values():  # warm each once over the ring
                    for i, w in enumerate(ring):
                        fn(w, i)
                for _ in range(args.rounds):
                    for name, fn in kernels.items():
                        t0 = time.perf_counter()
                        for i, w in enumerate(ring):
                            fn(w, i)
                        rates[name].append(len(ring) * size / (time.perf_counter() - t0))
                    bws.append(_core._read_bandwidth(flat, threads))
            bw = median(bws)
            for name, r in rates.items():
                rate = median(r)
                print(
                    f"| {dtype} | {rows} | {name} | {rate / 1e9:.1f} | {rate / bw:.2f} | "
                    f"{bw / 1e9:.1f} |"
                )
                sys.stdout.flush()
        del ring, packed, flat


if __name__ == "__main__":
    main()
