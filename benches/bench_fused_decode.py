"""Small decode steps: the fused step (every decoder layer in one extension call,
asyncllm.models.fused_decode) against the torch path, and both against reading every
weight once at the machine's DRAM bandwidth.

    python benches/bench_fused_decode.py [--models small llama1b] [--dtypes float32 bfloat16]
        [--rows 1 4 8] [--threads N] [--steps 12] [--quick]

One model runner per (model, dtype); its decode steps (`--rows` requests at context
64, greedy and sampled: temperature 1.0, top_p 0.95) alternate between the fused and
the torch path by switching the model's `fused_decode`, so load from elsewhere hits
both alike; the same kernels serve both (the runner's choice). Per path: the median
step (wall ms; and the step's CPU time where one thread runs it, which a loaded box
inflates less). "bound": every weight (layers and LM head) read once at the read
bandwidth the extension measures over a buffer 4x the last-level cache, with the
same threads, in the same run. The issue's target: batch-1 step <= 1.25x that bound.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_roofline import Shapes, llc_bytes, machine_header  # noqa: E402
from models import QUICK_HELP, build_model  # noqa: E402

from asyncllm import EngineArgs, SamplingParams, _core  # noqa: E402
from asyncllm.core.scheduler_output import NewRequestData, SchedulerOutput  # noqa: E402
from asyncllm.models.hf_config import load_hf_config  # noqa: E402
from asyncllm.worker.model_runner import ModelRunner  # noqa: E402

CONTEXT = 64
PARAMS = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=1 << 20, ignore_eos=True),
    "sampled": SamplingParams(
        temperature=1.0, top_p=0.95, seed=1, max_tokens=1 << 20, ignore_eos=True
    ),
}


def read_bandwidth(quick: bool) -> float:
    size = (1 << 26) if quick else max(4 * llc_bytes(), 1 << 30)
    data = np.ones(size // 4, dtype=np.float32)
    return _core._read_bandwidth(data, torch.get_num_threads())


def make_runner(model_dir: Path, dtype: str, rows: int) -> ModelRunner:
    hf = load_hf_config(model_dir)
    blocks = rows * (-(-(CONTEXT + 64) // 16)) + 1
    args = EngineArgs(
        model=str(model_dir),
        dtype=dtype,
        device="cpu",
        max_num_seqs=max(rows, 8),
        max_model_len=CONTEXT + 64,
        num_kv_blocks=blocks,
    )
    return ModelRunner(args.resolve(hf), hf)


def decode_steps(runner: ModelRunner, rows: int, params: SamplingParams, steps: int) -> Any:
    """Prefill `rows` requests of CONTEXT tokens, then yield after each decode step."""
    rng = np.random.default_rng(0)
    reqs, block = [], 0
    per_req = -(-(CONTEXT + 64) // 16)
    for i in range(rows):
        ids = rng.integers(3, 32000, CONTEXT).tolist()
        table = list(range(block, block + per_req))
        block += per_req
        reqs.append(NewRequestData(i, ids, CONTEXT, params, table, 0, frozenset()))
    n = dict.fromkeys(range(rows), CONTEXT)
    runner.execute_model(SchedulerOutput(reqs, {}, n, rows * CONTEXT)).resolved()
    ones = dict.fromkeys(range(rows), 1)
    for _ in range(steps):
        yield runner.execute_model(SchedulerOutput([], {}, ones, rows))


def measure(model_dir: Path, dtype: str, rows: int, args: argparse.Namespace) -> None:
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    weights = Shapes(load_hf_config(model_dir)).weight_bytes(itemsize)
    one_thread = torch.get_num_threads() == 1
    for name, params in PARAMS.items():
        runner = make_runner(model_dir, dtype, rows)  # one at a time: a large model's weights
        fused = runner.model.fused_decode
        if fused is None:
            print(f"| {model_dir.name} | {dtype} | {rows} | {name} | fused decode off |")
            return
        times: dict[bool, list[float]] = {True: [], False: []}
        cpu: dict[bool, list[float]] = {True: [], False: []}
        bw = read_bandwidth(args.quick)
        steps = decode_steps(runner, rows, params, 2 * args.steps + 2)
        for i, (wall, cpu_s) in enumerate(_timed(steps)):
            if i >= 2:  # the first steps warm both paths (and the first has the prefill)
                times[i % 2 == 0].append(wall)
                cpu[i % 2 == 0].append(cpu_s)
            runner.model.fused_decode = fused if (i + 1) % 2 == 0 else None  # the next step's
        bound = weights / bw
        f, t = median(times[True]), median(times[False])
        cf, ct = median(cpu[True]), median(cpu[False])
        cpu_col = f"{1e3 * cf:.2f} / {1e3 * ct:.2f}" if one_thread else "–"
        print(
            f"| {model_dir.name} | {dtype} | {rows} | {name} | {1e3 * f:.2f} | {1e3 * t:.2f} "
            f"| {t / f:.2f} | {cpu_col} | {1e3 * bound:.2f} ({bw / 1e9:.1f} GB/s) "
            f"| {f / bound:.2f} |",
            flush=True,
        )
        del runner, fused, steps


def _timed(steps: Any) -> Any:
    """(wall seconds, thread CPU seconds) of each step the generator runs."""
    while True:
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            out = next(steps)
        except StopIteration:
            return
        out.resolved()
        yield time.perf_counter() - t0, time.thread_time() - c0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=["small", "llama1b"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    p.add_argument("--rows", nargs="+", type=int, default=[1, 4, 8])
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--steps", type=int, default=12, help="decode steps per path")
    p.add_argument("--model-dir", default=None, help="where the benchmark models are built")
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = p.parse_args()
    if args.quick:
        args.models, args.rows, args.steps = ["micro"], [1], 2
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_header())
    print(
        "\n| model | dtype | rows | sampling | fused ms | torch path ms | torch / fused "
        "| CPU ms fused / torch | weights at bw ms | fused / bound |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|")
    root = Path(args.model_dir or tempfile.mkdtemp(prefix="fused-decode-"))
    for name in args.models:
        model_dir = build_model(name, root)
        for dtype in args.dtypes:
            for rows in args.rows:
                measure(model_dir, dtype, rows, args)


if __name__ == "__main__":
    with torch.inference_mode():
        main()
