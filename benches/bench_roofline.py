"""Roofline: how far the model runner's step is from what this machine allows.

    python benches/bench_roofline.py [--models micro small] [--dtypes float32 bfloat16]
        [--threads 2] [--batch 256] [--context 100] [--prefill 8x128] [--runs 3]
        [--compile] [--no-fused] [--eager-ops] [--quick]

The machine, never one library call: at each of the model's matmul shapes the best
of every kernel this install has (torch's F.linear, torch's prepacked oneDNN linear,
the extension's rust kernel at up to 16 rows; the best of a few calls each: a rate
the machine demonstrably reaches); the peak of the CPU's FMA units (the extension's
timed FMA loop on the same threads); and memory read bandwidth (the extension's
vector sum over a buffer 4x the last-level cache, at least 1 GiB, all threads). The
header names the CPU, its ISA flags and the kernels the engine chose per shape.

The bound of a step, per phase (a lower bound: each phase alone at the machine's
measured speed, no overlap between phases assumed):
  matmuls      the layers' q/k/v, o, gate/up and down projections: the best kernel's
               time at each shape (that time already covers reading the weights);
               beside it, the same FLOPs at the FMA peak
  attention    decode: the KV cache read once (batch x context x layers x 2 x
               kv_heads x head_dim x itemsize) at the bandwidth; prefill (causal,
               fresh prompts): its FLOPs at the best matmul rate measured
  elementwise  one pass over each fused op's inputs and outputs (the norms with
               their residual add, rotary in place on q and k, SiLU x up, the final
               norm, the embedding rows) at the bandwidth
  lm_head      the best kernel at (rows that sample, hidden, vocab)
  sampling     one read of the float32 logits of the sampled rows (greedy argmax)
The engine: the model runner's `execute_model` on the same shapes (requests placed
with their context already in the KV cache, so a decode step at context C needs no
prefill to get there), timed per phase by wrapping the projections, the attention
call, the forward, `compute_logits` and the sampler; elementwise = forward -
matmuls - attention (- fused); other = the rest of the step (input preparation, attention
metadata, bookkeeping). Each figure is the median of `--runs` runs; within a run the
machine's rates and the engine's step are measured back to back, so load from
elsewhere hits both alike. A small decode step whose layers run fused in one call
(asyncllm.models.fused_decode; `--no-fused` turns it off) reports them as "fused",
bound by the matmuls', attention's and elementwise work's bounds together; its
elementwise row is then the embedding and the final norm. Read "engine / bound"
per phase: 1.0 is the machine's speed; the total row is the step's distance from
its roofline.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import QUICK_HELP, build_model  # noqa: E402

PHASES = ("matmuls", "attention", "elementwise", "lm_head", "sampling", "other")


# --- the machine ---------------------------------------------------------------


def best_time(fn: Callable[[], Any], reps: int) -> float:
    fn()  # warm: first-call allocations and kernel selection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def gemm_time(m: int, k: int, n: int, dtype: torch.dtype, reps: int) -> float:
    """Seconds of the fastest kernel for x [m, k] . weight [n, k]^T, at its best."""
    from asyncllm.models.linear_kernels import (
        RUST_MAX_ROWS,
        onednn_available,
        pack_onednn,
        run_onednn,
        run_rust,
    )

    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    best = best_time(lambda: F.linear(x, w), reps)
    if onednn_available(dtype):
        packed = pack_onednn(w)
        best = min(best, best_time(lambda: run_onednn(x, packed, None), reps))
    if m <= RUST_MAX_ROWS:
        threads = torch.get_num_threads()
        best = min(best, best_time(lambda: run_rust(x, w, None, threads), reps))
    return best


_BUFFER: list[np.ndarray] = []


def llc_bytes() -> int:
    """The last-level cache's size from sysfs (0 if unknown)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * unit)
    return best


def read_bandwidth(reps: int) -> float:
    """Bytes/s of the extension's all-threads vector sum over a buffer 4x the
    last-level cache (at least 1 GiB; 64 MiB with --quick), at its best."""
    from asyncllm import _core

    if not _BUFFER:
        size = 64 << 20 if QUICK else max(1 << 30, 4 * llc_bytes())
        _BUFFER.append(np.ones(size // 4, dtype=np.float32))
    data, threads = _BUFFER[0], torch.get_num_threads()
    _core._read_bandwidth(data, threads)  # warm: page faults
    return max(_core._read_bandwidth(data, threads) for _ in range(max(reps, 1)))


def fma_peak() -> tuple[float, str]:
    """FLOP/s of the CPU's FMA units on torch's thread count, and the ISA used."""
    from asyncllm import _core

    _core._fma_peak(torch.get_num_threads(), 1_000_000)  # warm: clocks up
    runs = [_core._fma_peak(torch.get_num_threads(), 20_000_000) for _ in range(3)]
    return max(r[0] for r in runs), runs[0][1]


def machine_header() -> str:
    """The CPU model, its relevant ISA flags, thread count and the kernel variants."""
    from asyncllm import _core

    model, flags = platform.processor() or "unknown CPU", set()
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next(
            (ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), model
        )
        flags = set(next((ln for ln in lines if ln.startswith("flags")), "").split())
    except OSError:
        pass
    wanted = (
        "avx2",
        "fma",
        "avx512f",
        "avx512_bf16",
        "avx512_vnni",
        "avx_vnni",
        "amx_bf16",
        "amx_int8",
    )
    isa = " ".join(f for f in wanted if f in flags) or "none of AVX2/AVX-512/AMX"
    return (
        f"CPU {model}; {os.cpu_count()} CPUs; ISA {isa}; LLC {llc_bytes() >> 20} MiB; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; rust linear kernel "
        f"{_core._linear_isa()}, attention {_core._kernel_isa('bfloat16')}"
    )


# --- the model's shapes --------------------------------------------------------


class Shapes:
    def __init__(self, hf: Any) -> None:
        self.hidden = hf.hidden_size
        self.inter = hf.intermediate_size
        self.layers = hf.num_hidden_layers
        self.heads = hf.num_attention_heads
        self.kv_heads = getattr(hf, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(hf, "head_dim", None) or self.hidden // self.heads
        self.vocab = hf.vocab_size

    def layer_gemms(self, m: int) -> list[tuple[int, int, int]]:
        """(m, k, n) of one layer's projections, as the model fuses them."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h, i = self.hidden, self.inter
        return [(m, h, q + 2 * kv), (m, q, h), (m, h, 2 * i), (m, i, h)]

    def weight_bytes(self, itemsize: int) -> int:
        """Bytes of weights a decode step reads: every layer's projections, the LM
        head, one embedding row per token (negligible) and the norms."""
        per_layer = sum(k * n for _, k, n in self.layer_gemms(1)) + 2 * self.hidden
        return itemsize * (self.layers * per_layer + self.vocab * self.hidden + self.hidden)

    def elementwise_bytes(self, m: int, itemsize: int) -> int:
        """One pass over each fused elementwise op's inputs and outputs, per step."""
        h, i = self.hidden, self.inter
        qk = (self.heads + self.kv_heads) * self.head_dim
        per_layer = 2 * 4 * h + 2 * qk + 3 * i  # 2 norms+residual, rotary, SiLU x up
        return m * itemsize * (self.layers * per_layer + 4 * h + h)  # + final norm, embed


def bound(
    s: Shapes,
    dtype: torch.dtype,
    bw: float,
    tokens: int,
    sample_rows: int,
    attn: tuple[str, int, int],
    reps: int,
) -> tuple[dict[str, float], float]:
    """The step's lower bound per phase, in seconds (see the module docstring), and
    the layers' matmul FLOPs.
    `attn` = ("decode", batch, context) or ("prefill", num_prompts, prompt_len)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    rates = []
    matmuls = flops_total = 0.0
    for m, k, n in s.layer_gemms(tokens):
        t = gemm_time(m, k, n, dtype, reps)
        rates.append(2 * m * k * n / t)
        matmuls += s.layers * t
        flops_total += s.layers * 2 * m * k * n
    kind, a, b = attn
    if kind == "decode":
        kv_bytes = a * b * s.layers * 2 * s.kv_heads * s.head_dim * itemsize
        attention = kv_bytes / bw
    else:  # causal: q.k and p.v over b(b+1)/2 pairs per head
        flops = a * s.layers * s.heads * 4 * s.head_dim * b * (b + 1) / 2
        attention = flops / max(rates)
    return {
        "matmuls": matmuls,
        "attention": attention,
        "elementwise": s.elementwise_bytes(tokens, itemsize) / bw,
        "lm_head": gemm_time(sample_rows, s.hidden, s.vocab, dtype, reps),
        "sampling": sample_rows * s.vocab * 4 / bw,
        "other": 0.0,
    }, flops_total


# --- the engine ----------------------------------------------------------------


class PhaseTimer:
    """Wall time per phase of the runner's step, by wrapping the callables that make
    up each phase (CPU torch ops are synchronous: a call's time is its work)."""

    def __init__(self, runner: Any) -> None:
        import asyncllm.models.llama as llama

        self.t: dict[str, float] = defaultdict(float)
        model = runner.model
        for layer in model.layers:
            for mod in (layer.self_attn.qkv_proj, layer.self_attn.o_proj):
                self._wrap(mod, "forward", "matmuls")
            self._wrap(layer.mlp.gate_up_proj, "forward", "matmuls")
            self._wrap(layer.mlp.down_proj, "forward", "matmuls")
        fused = getattr(model, "fused_decode", None)
        if fused is not None:  # small decode steps: every layer in one call
            fused.plan = _TimedPlan(fused.plan, self.t)
        self._wrap(model, "forward", "forward")
        self._wrap(model, "compute_logits", "lm_head")
        self._wrap(llama, "paged_attention", "attention")
        runner.sampler = _Timed(runner.sampler, self.t)

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        orig = getattr(obj, name)
        t = self.t

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            out = orig(*args, **kwargs)
            t[phase] += time.perf_counter() - t0
            return out

        setattr(obj, name, timed)

    def step(self, runner: Any, so: Any) -> dict[str, float]:
        self.t.clear()
        t0 = time.perf_counter()
        runner.execute_model(so)
        total = time.perf_counter() - t0
        t = dict(self.t)
        for key in ("matmuls", "attention", "fused"):
            t.setdefault(key, 0.0)
        t["elementwise"] = t["forward"] - t["matmuls"] - t["attention"] - t["fused"]
        t["other"] = total - t["forward"] - t["lm_head"] - t["sampling"]
        t["total"] = total
        return t


class _Timed:
    def __init__(self, inner: Any, t: dict[str, float]) -> None:
        self.inner, self.t = inner, t

    def __call__(self, *args: Any) -> Any:
        t0 = time.perf_counter()
        out = self.inner(*args)
        self.t["sampling"] += time.perf_counter() - t0
        return out


class _TimedPlan:
    """The fused decode plan (asyncllm.models.fused_decode), its calls timed."""

    def __init__(self, inner: Any, t: dict[str, float]) -> None:
        self.inner, self.t = inner, t

    def run(self, *args: Any) -> None:
        t0 = time.perf_counter()
        self.inner.run(*args)
        self.t["fused"] += time.perf_counter() - t0


QUICK = False  # --quick: a small bandwidth buffer
FUSED = True  # --no-fused: small decode steps on the torch path (EngineArgs.fused_decode)
EAGER_OPS_ONLY = False  # --eager-ops: torch's elementwise ops, not the extension's
COMPILE = False  # --compile: the runner's fused layers (EngineArgs.compile)


def make_runner(model_dir: Path, dtype: str, seqs: int, max_len: int, blocks: int) -> Any:
    from asyncllm import EngineArgs
    from asyncllm.models.hf_config import load_hf_config
    from asyncllm.worker.model_runner import ModelRunner

    hf = load_hf_config(model_dir)
    args = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        max_num_seqs=seqs,
        max_model_len=max_len,
        num_kv_blocks=blocks,
        max_num_batched_tokens=max(seqs, 8192),
        compile=COMPILE,
        fused_decode=FUSED,
    )
    runner = ModelRunner(args.resolve(hf), hf)
    if EAGER_OPS_ONLY:
        from asyncllm.models.layers import EAGER_OPS, set_ops

        set_ops(runner.model, EAGER_OPS)
    return runner


def _requests(ids: range, lens: list[int], computed: list[int], block: int, bs: int) -> list:
    from asyncllm import SamplingParams
    from asyncllm.core.scheduler_output import NewRequestData

    rng = np.random.default_rng(ids.start)
    params = SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True)
    reqs = []
    for rid, n, c in zip(ids, lens, computed, strict=True):
        nb = -(-(n + 16) // bs)
        reqs.append(
            NewRequestData(
                rid,
                rng.integers(3, 32000, n).tolist(),
                n,
                params,
                list(range(block, block + nb)),
                c,
                frozenset(),
            )
        )
        block += nb
    return reqs


class DecodeDriver:
    """`batch` requests whose first `context - 1` tokens are already in the KV cache
    (zeros there: the time does not depend on the values), each step a decode."""

    def __init__(self, model_dir: Path, dtype: str, batch: int, context: int, bs: int) -> None:
        from asyncllm.core.scheduler_output import SchedulerOutput

        blocks = batch * -(-(context + 16) // bs) + 1
        self.runner = make_runner(model_dir, dtype, batch, context + 32, blocks)
        self.timer = PhaseTimer(self.runner)
        reqs = _requests(range(batch), [context] * batch, [context - 1] * batch, 0, bs)
        ones = {r.req_id: 1 for r in reqs}
        self.first: Any = SchedulerOutput(reqs, {}, ones, batch)
        self.next = SchedulerOutput([], {}, ones, batch)

    def step(self) -> dict[str, float]:
        so, self.first = self.first or self.next, None
        return self.timer.step(self.runner, so)


class PrefillDriver:
    """A chunk of `prompts` fresh prompts of `length` tokens, each ending in the step
    (one sampled row per prompt); every step new requests, the last ones finished."""

    def __init__(self, model_dir: Path, dtype: str, prompts: int, length: int, bs: int) -> None:
        blocks = prompts * -(-(length + 16) // bs) + 1
        self.runner = make_runner(model_dir, dtype, prompts, length + 32, blocks)
        self.timer = PhaseTimer(self.runner)
        self.prompts, self.length, self.bs = prompts, length, bs
        self.done: set[int] = set()
        self.next_id = 0

    def step(self) -> dict[str, float]:
        from asyncllm.core.scheduler_output import SchedulerOutput

        ids = range(self.next_id, self.next_id + self.prompts)
        self.next_id += self.prompts
        n = self.prompts
        reqs = _requests(ids, [self.length] * n, [0] * n, 0, self.bs)
        so = SchedulerOutput(
            reqs, {}, {i: self.length for i in ids}, n * self.length, finished_req_ids=self.done
        )
        self.done = set(ids)
        return self.timer.step(self.runner, so)


# --- the table -----------------------------------------------------------------


def measure(
    name: str, model_dir: Path, dtype: str, args: argparse.Namespace
) -> list[dict[str, Any]]:
    from asyncllm.models.hf_config import load_hf_config

    s = Shapes(load_hf_config(model_dir))
    tdtype = getattr(torch, dtype)
    np_, plen = (int(x) for x in args.prefill.split("x"))
    makers: dict[str, tuple[str, int, Any]] = {
        "decode": (
            "decode",
            args.batch,
            lambda: DecodeDriver(model_dir, dtype, args.batch, args.context, 16),
        ),
        "decode1": ("decode", 1, lambda: DecodeDriver(model_dir, dtype, 1, args.context, 16)),
        "prefill": ("prefill", np_, lambda: PrefillDriver(model_dir, dtype, np_, plen, 16)),
    }
    rows = []
    peak, _ = fma_peak()
    itemsize = torch.empty((), dtype=tdtype).element_size()
    for case in args.cases:
        # one runner at a time: a large model's weights are held once
        phase, batch, make = makers[case]
        driver = make()
        driver.step()  # warm: first-call allocations, workspace growth
        engine_runs, bound_runs = [], []
        for _ in range(args.runs):
            bw = read_bandwidth(args.reps)
            if phase == "decode":
                b, flops = bound(
                    s, tdtype, bw, batch, batch, ("decode", batch, args.context), args.reps
                )
            else:
                b, flops = bound(s, tdtype, bw, np_ * plen, np_, ("prefill", np_, plen), args.reps)
            engine_runs.append(driver.step())
            b["total"] = sum(b.values())
            # the fused call runs the layers' matmuls, attention and elementwise work
            b["fused"] = b["matmuls"] + b["attention"] + b["elementwise"]
            b["bandwidth"] = bw
            b["weights_at_bw"] = s.weight_bytes(itemsize) / bw
            b["matmuls_at_peak"] = flops / peak
            bound_runs.append(b)
        row: dict[str, Any] = {
            "model": name,
            "dtype": dtype,
            "phase": f"{phase} x{batch}",
            "kernels": driver.runner.linear_kernels,
            "peak_gflops": peak / 1e9,
            "weights_at_bw_ms": 1e3 * median(r["weights_at_bw"] for r in bound_runs),
            "matmuls_at_peak_ms": 1e3 * median(r["matmuls_at_peak"] for r in bound_runs),
        }
        for key in (*PHASES, "fused", "total"):
            row[f"engine_{key}"] = 1e3 * median(r.get(key, 0.0) for r in engine_runs)
            row[f"bound_{key}"] = 1e3 * median(r[key] for r in bound_runs)
        row["bandwidth_gbs"] = median(r["bandwidth"] for r in bound_runs) / 1e9
        row["ratio_total"] = median(
            e["total"] / b["total"] for e, b in zip(engine_runs, bound_runs, strict=True)
        )
        row["ratio_weights"] = median(
            e["total"] / b["weights_at_bw"] for e, b in zip(engine_runs, bound_runs, strict=True)
        )
        rows.append(row)
        print_rows([row])
        del driver  # before the next case's runner loads its own weights
        gc.collect()
    return rows


def print_rows(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"\n{r['model']} {r['dtype']} {r['phase']} (read bandwidth "
            f"{r['bandwidth_gbs']:.1f} GB/s; engine / bound of the totals, per run: "
            f"median {r['ratio_total']:.2f})"
        )
        print(
            f"matmuls at the FMA peak ({r['peak_gflops']:.0f} GFLOP/s): "
            f"{r['matmuls_at_peak_ms']:.2f} ms; every weight read once at the bandwidth: "
            f"{r['weights_at_bw_ms']:.2f} ms (step / that: {r['ratio_weights']:.2f})"
        )
        kernels = "; ".join(f"{k} {_runs(v)}" for k, v in r["kernels"].items())
        print(f"kernels chosen: {kernels or 'F.linear'}")
        print("| phase | engine ms | bound ms | engine / bound |")
        print("|---|---:|---:|---:|")
        for key in (*PHASES, "fused", "total"):
            e, b = r[f"engine_{key}"], r[f"bound_{key}"]
            if key == "fused" and e == 0:
                continue  # the step ran on the torch path
            ratio = f"{e / b:.2f}" if b > 0 and e > 0 else "-"
            print(f"| {key} | {e:.2f} | {b:.2f} | {ratio} |")
    sys.stdout.flush()


def _runs(kernels: tuple[str, ...]) -> str:
    from asyncllm.worker.linear_select import describe_kernels

    return describe_kernels(kernels)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["micro", "small"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--batch", type=int, default=256, help="decodes per step")
    p.add_argument("--context", type=int, default=100, help="tokens each decode attends to")
    p.add_argument("--prefill", default="8x128", help="prefill chunk: PROMPTSxLENGTH")
    p.add_argument(
        "--cases",
        nargs="+",
        default=["decode", "decode1", "prefill"],
        choices=["decode", "decode1", "prefill"],
        help="decode at --batch rows, decode of one row, a prefill chunk",
    )
    p.add_argument("--runs", type=int, default=3, help="runs; every figure is their median")
    p.add_argument("--reps", type=int, default=3, help="calls per machine-rate measurement")
    p.add_argument("--model-dir", default=None, help="where the benchmark models are built")
    p.add_argument(
        "--compile", action="store_true", help="fused layers (EngineArgs.compile) in the engine"
    )
    p.add_argument(
        "--no-fused",
        action="store_true",
        help="small decode steps on the torch path, not fused (EngineArgs.fused_decode)",
    )
    p.add_argument(
        "--eager-ops",
        action="store_true",
        help="torch's elementwise ops between the matmuls, not the extension's (native_ops)",
    )
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = p.parse_args()
    global COMPILE, QUICK, FUSED, EAGER_OPS_ONLY
    COMPILE, QUICK, FUSED = args.compile, args.quick, not args.no_fused
    EAGER_OPS_ONLY = args.eager_ops
    if args.quick:
        args.models, args.batch, args.context, args.prefill = ["micro"], 8, 20, "2x16"
        args.runs, args.reps = 1, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        machine_header()
        + f"; compile {'on' if args.compile else 'off'}; fused decode {'on' if FUSED else 'off'}"
        + f"; elementwise ops {'torch' if EAGER_OPS_ONLY else 'extension'}"
    )
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="roofline-"))
    for name in args.models:
        model_dir = build_model(name, root)
        for dtype in args.dtypes:
            measure(name, model_dir, dtype, args)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
