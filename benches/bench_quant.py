"""Quantized weights kept quantized: the GGUF kernels against the machine's memory
bound and bf16 GEMMs (`--parts kernels`: benches/quant_kernels.py), and
SmolLM2-135M-Instruct from its GGUF (Q4_1 layers, Q8_0 embedding) against the same
weights dequantized to a bf16 safetensors checkpoint, in the engine (`--parts
smollm2`).

    python benches/bench_quant.py [--parts kernels smollm2] [--kernel-rows 1 64]
        [--shapes 2048x5632 ...] [--types Q4_1 ...] [--one-thread] [--rounds 3]
        [--tokens 64] [--streams 64] [--quick]

Reported, for SmolLM2:
  - load: `load_model` in this process (the GGUF's folder prepared beforehand, as a
    second start finds it), the median of `--rounds`; and the engine's start-up
    (`LLM(...)` until ready: a fresh core process, kernel choice cached);
  - memory: the resident memory `load_model` adds in a fresh process, against the
    GGUF file's size; and the engine core's whole RSS beside its KV cache's bytes;
  - tokens/s: batch-1 decode (one chat prompt, `--tokens` new tokens) and
    `--streams` concurrent chats, greedy and sampled (temperature 1.0, top_p 0.95,
    a seed per request), the two engines alternating round by round; the median of
    `--rounds`, and the median of the per-round ratios GGUF / bf16.

The issue's targets: RSS <= 1.3x the file size plus the KV cache; GGUF no slower than
bf16 at batch 1 and 64 streams; load <= 3 s.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))
from bench_roofline import machine_header  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402
from models import QUICK_HELP  # noqa: E402
from quant_kernels import SHAPES, TYPES, kernel_rows  # noqa: E402

from asyncllm import LLM, SamplingParams, _core  # noqa: E402
from asyncllm.gguf_files import prepare_gguf  # noqa: E402
from asyncllm.models.construct import get_model_class, uninitialised  # noqa: E402
from asyncllm.models.gguf.tensors import GGUFTensors  # noqa: E402
from asyncllm.models.hf_config import load_hf_config  # noqa: E402

BLOCK_SIZE = 16
FIXTURE = ROOT / "tests" / "fixtures" / "smollm2_greedy.json"

# A fresh interpreter's resident memory before and after load_model (MiB).
_RSS_PROBE = """
import sys, torch
from asyncllm.models.hf_config import load_hf_config
from asyncllm.models.loader import load_model
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
folder, dtype = sys.argv[1], getattr(torch, sys.argv[2])
cfg = load_hf_config(folder)
before = rss()
model = load_model(folder, cfg, dtype, torch.device("cpu"))
print(before, rss())
"""


def dense_checkpoint(folder: Path, out: Path) -> Path:
    """The GGUF's weights dequantized (as transformers does) into a bf16 safetensors
    Hugging Face directory beside the same config and tokenizer."""
    from safetensors.torch import save_file

    cfg = load_hf_config(folder)
    with uninitialised(torch.float32, torch.device("meta")):
        model = get_model_class(cfg)(cfg)
    names = sorted({n for srcs in model.weight_sources().values() for n in srcs})
    tensors = GGUFTensors(folder, cfg)
    save_file({n: tensors.float(n).to(torch.bfloat16) for n in names}, out / "model.safetensors")
    for f in folder.iterdir():
        if f.suffix in (".json", ".jinja") and f.name != "gguf.json":
            shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
    return out


def rss_of(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def descendants(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def load_times(folder: Path, dtype: torch.dtype, rounds: int) -> float:
    from asyncllm.models.loader import load_model

    cfg = load_hf_config(folder)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        load_model(folder, cfg, dtype, torch.device("cpu"))
        times.append(time.perf_counter() - t0)
    return median(times)


def load_rss(folder: Path, dtype: str) -> float:
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(folder), dtype],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[1]) - float(out[0])


def kv_bytes(folder: Path, num_blocks: int, itemsize: int) -> int:
    cfg = load_hf_config(folder)
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return int(num_blocks * BLOCK_SIZE * per_token)


def decode_rates(llm: LLM, conversations: list[Any], tokens: int, streams: int) -> dict[str, float]:
    """Output tokens/s: batch 1 and `streams` chats, greedy and sampled."""
    rates = {}
    for kind in ("greedy", "sampled"):
        for n in (1, streams):
            params = [
                SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
                if kind == "greedy"
                else SamplingParams(
                    max_tokens=tokens, ignore_eos=True, temperature=1.0, top_p=0.95, seed=i
                )
                for i in range(n)
            ]
            chats = [conversations[i % len(conversations)] for i in range(n)]
            t0 = time.perf_counter()
            outs = llm.chat(chats, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            rates[f"{kind} x{n}"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    ap.add_argument("--parts", nargs="+", default=["kernels", "smollm2"])
    ap.add_argument("--kernel-rows", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="OUTxIN")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument(
        "--one-thread", action="store_true", help="kernels on one thread, in thread CPU time"
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.streams = 1, 4, 4
    print(machine_header(), f"torch threads {torch.get_num_threads()}", flush=True)
    print(f"integer kernel path: {_core._gguf_int_isa()}", flush=True)
    if "kernels" in args.parts:
        if args.one_thread:
            torch.set_num_threads(1)
        kernel_rows(args.kernel_rows, args.rounds, args.quick, args.shapes, args.types)
    if "smollm2" in args.parts:
        smollm2(args)


def smollm2(args: argparse.Namespace) -> None:
    """The engine rows: SmolLM2 from its GGUF against the same weights in bf16."""
    path = fetch()
    folder = prepare_gguf(path)
    conversations = [c["messages"] for c in json.loads(FIXTURE.read_text())["cases"]]
    num_blocks = max(args.streams * -(-(64 + args.tokens) // BLOCK_SIZE), 1024 // BLOCK_SIZE) + 8
    with tempfile.TemporaryDirectory() as tmp:
        dense = dense_checkpoint(folder, Path(tmp))
        setups = {
            "gguf": (folder, "float32", str(path)),
            "bf16": (dense, "bfloat16", str(dense)),
        }
        report: dict[str, dict[str, Any]] = {}
        engines = {}
        for name, (where, dtype, model) in setups.items():
            row = report[name] = {}
            row["load_s"] = load_times(where, getattr(torch, dtype), args.rounds)
            row["load_rss_mib"] = load_rss(where, dtype)
            before = set(descendants(os.getpid()))
            t0 = time.perf_counter()
            engines[name] = LLM(
                model=model, dtype=dtype, num_kv_blocks=num_blocks, max_model_len=1024
            )
            row["startup_s"] = time.perf_counter() - t0
            core = max(set(descendants(os.getpid())) - before, key=rss_of)
            row["core_rss_mib"] = rss_of(core)
            row["kv_mib"] = kv_bytes(where, num_blocks, getattr(torch, dtype).itemsize) / 2**20
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                runs[name].append(decode_rates(llm, conversations, args.tokens, args.streams))
        for llm in engines.values():
            llm.shutdown()
    print_report(report, runs, path.stat().st_size / 2**20)


def print_report(
    report: dict[str, dict[str, Any]], runs: dict[str, list[dict[str, float]]], file_mib: float
) -> None:
    print(f"\nGGUF file {file_mib:.1f} MiB")
    print(
        "| model | load_model s | RSS added by load MiB (/ file) | start-up s "
        "| core RSS MiB | KV MiB |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in report.items():
        print(
            f"| {name} | {r['load_s']:.2f} | {r['load_rss_mib']:.0f} "
            f"({r['load_rss_mib'] / file_mib:.2f}) | {r['startup_s']:.1f} | "
            f"{r['core_rss_mib']:.0f} | {r['kv_mib']:.0f} |"
        )
    keys = list(runs["gguf"][0])
    print("\n| tokens/s | gguf | bf16 | gguf / bf16 (median of per-round ratios) |")
    print("|---|---:|---:|---:|")
    for key in keys:
        g = [r[key] for r in runs["gguf"]]
        b = [r[key] for r in runs["bf16"]]
        ratio = median(x / y for x, y in zip(g, b, strict=True))
        print(f"| {key} | {median(g):.1f} | {median(b):.1f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
