"""The GGUF kernels against the machine: `bench_quant.py --parts kernels`.

For each shape ([out, in]) and block type, a ring of distinct weights totalling 2x
the last-level cache (at least 256 MiB, at most 1 GiB; 8 MiB with --quick) is visited in turn, as a
decode step visits its layers, so every call reads its weight from memory. Per row
count and kernel (`GGUFLinear.run`: int and float up to 16 rows, int, tiles and
tiles_bf16 beyond; tiles at one row are slower by construction; and up to 16 rows
`int (call)`, the extension's integer kernel called directly, as the fused decode
step calls it for each projection, without the Python layer's ~10 µs): the time per
matrix, the median of `rounds` passes, kernels alternating pass by pass; beside it
the memory bound (the matrix's block bytes / the DRAM read bandwidth, measured in
the same loop by the extension's vector sum) and the fastest bf16 GEMM on the same
shape (torch's F.linear or oneDNN's prepacked linear over a bf16 ring).

On a loaded machine, `--one-thread` runs everything on the calling thread and
times it in thread CPU time (`time.thread_time`), the bandwidth probe included:
time the OS gives other processes then counts for no one (memory stalls still do).

The blocks are random bytes with small finite scales: the kernels' speed does not
depend on the values (gguf-py cannot quantize the K types).
"""

from __future__ import annotations

import time
from statistics import median

import numpy as np
import torch
import torch.nn.functional as F
from bench_roofline import llc_bytes

from asyncllm import _core
from asyncllm.models.gguf.dequant import BLOCK_SIZES, row_bytes
from asyncllm.models.gguf.layers import FUSED_MAX_ROWS, GGUFLinear
from asyncllm.models.linear_kernels import onednn_available, pack_onednn, run_onednn

SHAPES = ("2048x2048", "2048x5632", "5632x2048")
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
# where each type's f16 scales sit in its block
SCALES = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q6_K": [208]}


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    size = BLOCK_SIZES[qtype][1]
    raw = rng.integers(0, 256, size=(n * row_bytes(qtype, k) // size, size), dtype=np.uint8)
    for at in SCALES[qtype]:
        scale = rng.uniform(-0.02, 0.02, (len(raw), 1)).astype(np.float16)
        raw[:, at : at + 2] = scale.view(np.uint8)
    return torch.from_numpy(raw.reshape(n, -1))


def _clock() -> float:
    """Thread CPU time on one thread (every kernel then runs on this thread), else
    wall time."""
    return time.thread_time() if torch.get_num_threads() == 1 else time.perf_counter()


def _pass(fn, ring: list) -> float:  # type: ignore[no-untyped-def]
    t0 = _clock()
    for item in ring:
        fn(item)
    return (_clock() - t0) / len(ring)


def _bandwidth(flat: np.ndarray) -> float:
    """Bytes/s of the extension's vector sum over `flat`, on the clock of `_clock`."""
    threads = torch.get_num_threads()
    t0 = _clock()
    rate = _core._read_bandwidth(flat, threads)
    return rate if threads > 1 else flat.nbytes / (_clock() - t0)


def bf16_best(n: int, k: int, rows: int, total: int, rounds: int) -> tuple[float, str]:
    """Seconds per matrix of the fastest bf16 GEMM here over a ring of bf16 weights."""
    ring = [torch.randn(n, k).to(torch.bfloat16) for _ in range(max(2, total // (2 * n * k)))]
    x = torch.randn(rows, k).to(torch.bfloat16)
    fns = {"F.linear": (lambda w: F.linear(x, w), ring)}
    if onednn_available(torch.bfloat16):
        packed = [pack_onednn(w) for w in ring]
        fns["onednn"] = (lambda p: run_onednn(x, p, None), packed)
    times: dict[str, list[float]] = {name: [] for name in fns}
    with torch.inference_mode():
        for fn, items in fns.values():
            _pass(fn, items)
        for _ in range(rounds):
            for name, (fn, items) in fns.items():
                times[name].append(_pass(fn, items))
    best = min(times, key=lambda name: median(times[name]))
    return median(times[best]), best


def kernel_rows(
    rows_list: list[int], rounds: int, quick: bool, shapes: list[str], types: list[str]
) -> list[dict]:
    """One dict per (shape, type, rows, kernel), each printed as it is measured."""
    total = 8 << 20 if quick else max(256 << 20, min(2 * llc_bytes(), 1 << 30))
    if quick:
        shapes, types = ["256x512"], ["Q8_0", "Q4_1"]
    print_header(total)
    flat = np.ones(total // 4, dtype=np.float32)
    rng = np.random.default_rng(0)
    out = []
    for shape in shapes:
        n, k = (int(v) for v in shape.split("x"))
        bf16 = {rows: bf16_best(n, k, rows, total, rounds) for rows in rows_list}
        for qtype in types:
            nbytes = n * row_bytes(qtype, k)
            one = random_blocks(qtype, n, k, rng)
            ring = [GGUFLinear([(qtype, one.clone())], k, None) for _ in range(total // nbytes)]
            for layer in ring:
                layer.pack_panels()  # as the loader lays them out
            raws = [layer.part0.numpy() for layer in ring]
            for rows in rows_list:
                x = torch.randn(rows, k)
                runs = {
                    name: (lambda layer, name=name, x=x: layer.run(name, x), ring)
                    for name in (
                        ["int", "float"]
                        if rows <= FUSED_MAX_ROWS
                        else ["int", "tiles", "tiles_bf16"]
                    )
                }
                if rows <= FUSED_MAX_ROWS:
                    runs["int (call)"] = (_int_call(qtype, x, n), raws)
                names = list(runs)
                times: dict[str, list[float]] = {name: [] for name in names}
                bws = []
                with torch.inference_mode():
                    for fn, items in runs.values():
                        _pass(fn, items[:2])
                    for _ in range(rounds):
                        for name, (fn, items) in runs.items():
                            times[name].append(_pass(fn, items))
                        bws.append(_bandwidth(flat))
                bound = nbytes / median(bws)
                for name in names:
                    t = median(times[name])
                    out.append(
                        row := dict(
                            shape=shape,
                            qtype=qtype,
                            rows=rows,
                            kernel=name,
                            ms=t * 1e3,
                            of_bound=t / bound,
                            bw=median(bws) / 1e9,
                            bf16_ms=bf16[rows][0] * 1e3,
                            bf16_kernel=bf16[rows][1],
                        )
                    )
                    print_row(row)
            del ring
    return out


def _int_call(qtype: str, x: torch.Tensor, n: int):  # type: ignore[no-untyped-def]
    """The integer kernel called as the fused decode step calls it, once per
    projection from the extension with its buffers ready: the Python layer's
    per-call work (`GGUFLinear.run`: the output tensor, views, dtype checks; ~10 µs)
    left out."""
    xn = x.float().contiguous().numpy()
    out, threads = np.empty((x.shape[0], n), np.float32), torch.get_num_threads()
    return lambda raw: _core._gguf_linear_int(qtype, out, xn, raw, threads, panels=True)


def print_header(total: int) -> None:
    print(f"\nrings of {total >> 20} MiB per shape and type; {torch.get_num_threads()} threads")
    print(
        "\n| shape | type | rows | kernel | ms | time / memory bound | read bw GB/s "
        "| best bf16 GEMM ms | bf16 / this |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|", flush=True)


def print_row(r: dict) -> None:
    print(
        f"| {r['shape']} | {r['qtype']} | {r['rows']} | {r['kernel']} | {r['ms']:.3f} | "
        f"{r['of_bound']:.2f} | {r['bw']:.1f} | {r['bf16_ms']:.3f} ({r['bf16_kernel']}) | "
        f"{r['bf16_ms'] / r['ms']:.2f} |",
        flush=True,
    )
