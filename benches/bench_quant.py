"""Quantized weights kept quantized: the GGUF kernels against the machine's memory
bound and bf16 GEMMs (`--parts kernels`: benches/quant_kernels.py), and
SmolLM2-135M-Instruct from its GGUF (Q4_1 layers, Q8_0 embedding) against the same
weights dequantized to a bf16 safetensors checkpoint, in the engine (`--parts
smollm2`); and the other quantized encodings of those bf16 weights:
`--quantization int8` / `int4` at load, and compressed-tensors checkpoints written
from them (W8A8 int8 with dynamic per-token inputs, W4A16 groups of 32; needs
`pip install 'asyncllm[compressed-tensors]'`). Not by default, `--parts llama1b`:
issue 28's model target, a random 1B-shaped Llama as GGUF Q8_0, Q4_0 (gguf-py) and
Q4_K_M (llama.cpp's quantizer) against the same weights in bf16, tokens/s only
(benches/quant_llama1b.py; 3.6 GB of files written on first use).

    python benches/bench_quant.py [--parts kernels smollm2 llama1b] [--kernel-rows 1 64]
        [--shapes 2048x5632 ...] [--types Q4_1 ...] [--one-thread] [--rounds 3]
        [--tokens 64] [--streams 64] [--gguf-dtype auto|float32|bfloat16] [--quick]
        [--setups gguf,gguf-bf16,bf16,int8,int4,ct-w8a8,ct-w4a16]

Reported, for each SmolLM2 setup:
  - load: `load_model` in this process (the GGUF's folder prepared beforehand, as a
    second start finds it), the median of `--rounds`; and the engine's start-up
    (`LLM(...)` until ready: a fresh core process, kernel choice cached);
  - memory: the resident memory `load_model` adds in a fresh process, against the
    GGUF file's size; and the engine core's whole RSS beside its KV cache's bytes;
  - tokens/s: batch-1 decode (one chat prompt, `--tokens` new tokens) and
    `--streams` concurrent chats, greedy and sampled (temperature 1.0, top_p 0.95,
    a seed per request), the two engines alternating round by round; the median of
    `--rounds`, and the median of the per-round ratios to bf16.

The issue's targets: RSS <= 1.3x the file size plus the KV cache; GGUF no slower than
bf16 at batch 1 and 64 streams; load <= 3 s. For llama1b (the same tokens/s rows,
distinct 32-token prompts, the four engines alternating; `--quick`: a 2-layer model
of hidden 256, only bf16 and Q4_K_M started): batch 1 >= 1.8x bf16 for Q8_0 and
>= 3x for the 4-bit files, `--streams` >= 1.0x. Its GGUF engines run as `LLM(path)`
does by default (`--gguf-dtype auto`: bf16 activations where the CPU has bf16 dot
instructions); `--gguf-dtype float32` keeps float32 activations, as the runs before
Dec 5 10:40 UTC did.
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

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))
from bench_roofline import machine_header  # noqa: E402
from compressed_checkpoint import write_compressed  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402
from models import QUICK_HELP  # noqa: E402
from quant_kernels import SHAPES, TYPES, kernel_rows  # noqa: E402
from quant_llama1b import FULL, QUICK, TARGETS, describe, write_models  # noqa: E402

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
quantization = sys.argv[3] if len(sys.argv) > 3 else None
cfg = load_hf_config(folder)
before = rss()
model = load_model(folder, cfg, dtype, torch.device("cpu"), quantization)
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


def load_times(folder: Path, dtype: torch.dtype, rounds: int, quantization: str | None) -> float:
    from asyncllm.models.loader import load_model

    cfg = load_hf_config(folder)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        load_model(folder, cfg, dtype, torch.device("cpu"), quantization)
        times.append(time.perf_counter() - t0)
    return median(times)


def load_rss(folder: Path, dtype: str, quantization: str | None) -> float:
    extra = [quantization] if quantization else []
    out = subprocess.run(
        [sys.executable, "-c", _RSS_PROBE, str(folder), dtype, *extra],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return float(out[1]) - float(out[0])


def kv_bytes(folder: Path, num_blocks: int, itemsize: int) -> int:
    cfg = load_hf_config(folder)
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return int(num_blocks * BLOCK_SIZE * per_token)


ROWS = ("greedy", "sampled")


def decode_rate(llm: LLM, prompts: list[Any], tokens: int, kind: str, n: int) -> float:
    """Output tokens/s of `n` requests, greedy or sampled. `prompts` are chats (lists
    of messages) or the engine's prompts ({"prompt_token_ids": ...})."""
    submit = llm.chat if isinstance(prompts[0], list) else llm.generate
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
        if kind == "greedy"
        else SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=1.0, top_p=0.95, seed=i)
        for i in range(n)
    ]
    batch = [prompts[i % len(prompts)] for i in range(n)]
    t0 = time.perf_counter()
    outs = submit(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def alternate_rates(
    engines: dict[str, LLM], prompts: list[Any], args: argparse.Namespace
) -> dict[str, list[dict[str, float]]]:
    """Each engine's tokens/s at batch 1 and `--streams`, greedy and sampled, row by
    row: every engine runs a row before any runs the next, in reversed order every
    other round, so the rates a ratio compares are taken seconds apart (this host's
    speed moves by up to 1.3x within a minute; with each engine running all four
    rows in turn, one engine's greedy and sampled batch-1 rates had differed by 1.3x
    in one round). Then the engines shut down."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in engines}
    for r in range(args.rounds):
        for rates in runs.values():
            rates.append({})
        order = list(engines.items())[:: -1 if r % 2 else 1]
        for kind in ROWS:
            for n in (1, args.streams):
                for name, llm in order:
                    runs[name][r][f"{kind} x{n}"] = decode_rate(llm, prompts, args.tokens, kind, n)
    for llm in engines.values():
        llm.shutdown()
    return runs


def int_mm_table(reps: int = 7) -> None:
    """W8A8's integer product: `torch._int_mm` (int32 sums) against the float GEMM on
    the same integers as float32 (which QuantLinear would otherwise run), over
    SmolLM2's MLP shapes; median microseconds of `reps` timings of 10 calls each."""
    print("\n| W8A8 product [rows x in] . [out x in] | torch._int_mm us | float GEMM us | ratio |")
    print("|---|---:|---:|---:|")
    for out, k in ((1536, 576), (576, 1536)):
        w = torch.randint(-127, 128, (out, k), dtype=torch.int8)
        for rows in (1, 4, 64, 256):
            x = torch.randint(-127, 128, (rows, k), dtype=torch.int8)
            fns = {
                "int": lambda x=x, w=w: torch._int_mm(x, w.t()).float(),
                "float": lambda x=x, w=w: torch.nn.functional.linear(x.float(), w.float()),
            }
            times: dict[str, list[float]] = {name: [] for name in fns}
            for _ in range(reps):
                for name, fn in fns.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(10):
                        fn()
                    times[name].append((time.perf_counter() - t0) / 10 * 1e6)
            a, b = median(times["int"]), median(times["float"])
            print(f"| [{rows} x {k}] . [{out} x {k}] | {a:.0f} | {b:.0f} | {b / a:.1f} |")


SETUPS = ("gguf", "gguf-bf16", "bf16", "int8", "int4", "ct-w8a8", "ct-w4a16")


def setups_for(names: list[str], path: Path, folder: Path, tmp: Path) -> dict[str, Any]:
    """Per setup: (the folder load_model reads, dtype, the engine's model, quantization)."""
    (tmp / "bf16").mkdir()
    dense = dense_checkpoint(folder, tmp / "bf16")
    table: dict[str, Any] = {
        "gguf": (folder, "float32", str(path), None),
        # the same blocks with bf16 activations (norms, attention, the residual
        # stream and the KV cache in bf16, as the bf16 engine runs them)
        "gguf-bf16": (folder, "bfloat16", str(path), None),
        "bf16": (dense, "bfloat16", str(dense), None),
        "int8": (dense, "bfloat16", str(dense), "int8"),
        "int4": (dense, "bfloat16", str(dense), "int4"),
    }
    # groups of 32: SmolLM2's hidden size 576 is not a multiple of 128
    for name, scheme in (("ct-w8a8", "w8a8"), ("ct-w4a16", "w4a16_g32_sym")):
        if name in names:
            out = write_compressed(dense, tmp / name, scheme)
            table[name] = (out, "bfloat16", str(out), None)
    return {name: table[name] for name in names}


def start_engines(
    setups: dict[str, Any], rounds: int, num_blocks: int
) -> tuple[dict[str, dict[str, Any]], dict[str, LLM]]:
    """Each setup's load figures and its running engine."""
    report: dict[str, dict[str, Any]] = {}
    engines = {}
    for name, (where, dtype, model, quantization) in setups.items():
        row = report[name] = {}
        row["load_s"] = load_times(where, getattr(torch, dtype), rounds, quantization)
        row["load_rss_mib"] = load_rss(where, dtype, quantization)
        before = set(descendants(os.getpid()))
        t0 = time.perf_counter()
        engines[name] = LLM(
            model=model,
            dtype=dtype,
            num_kv_blocks=num_blocks,
            max_model_len=1024,
            quantization=quantization,
        )
        row["startup_s"] = time.perf_counter() - t0
        core = max(set(descendants(os.getpid())) - before, key=rss_of)
        row["core_rss_mib"] = rss_of(core)
        row["kv_mib"] = kv_bytes(where, num_blocks, getattr(torch, dtype).itemsize) / 2**20
    return report, engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--setups", default=",".join(SETUPS), help=f"comma-separated, of {SETUPS}")
    ap.add_argument("--parts", nargs="+", default=["kernels", "smollm2"])
    ap.add_argument("--kernel-rows", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), help="OUTxIN")
    ap.add_argument("--types", nargs="+", default=list(TYPES))
    ap.add_argument(
        "--one-thread", action="store_true", help="kernels on one thread, in thread CPU time"
    )
    ap.add_argument(
        "--gguf-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="llama1b's GGUF engines' activations (auto: the engine's default, bfloat16 "
        "on a CPU with bf16 dot instructions, else float32)",
    )
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    if args.quick:  # one setup per loader: the GGUF, --quantization, compressed-tensors
        args.rounds, args.tokens, args.streams = 1, 4, 4
        args.setups = "gguf,bf16,int4,ct-w8a8"
    names = args.setups.split(",")
    if "bf16" not in names or not set(names) <= set(SETUPS):
        ap.error(f"--setups: names from {SETUPS}, bf16 among them (the baseline)")
    print(machine_header(), f"torch threads {torch.get_num_threads()}", flush=True)
    print(f"integer kernel path: {_core._gguf_int_isa()}", flush=True)
    if "kernels" in args.parts:
        if args.one_thread:
            torch.set_num_threads(1)
        kernel_rows(args.kernel_rows, args.rounds, args.quick, args.shapes, args.types)
    if "smollm2" in args.parts:
        int_mm_table(1 if args.quick else 7)
        smollm2(args, names)
    if "llama1b" in args.parts:
        llama1b(args)


def smollm2(args: argparse.Namespace, names: list[str]) -> None:
    """The engine rows: SmolLM2 from its GGUF and its other encodings against the
    same weights in bf16."""
    path = fetch()
    folder = prepare_gguf(path)
    conversations = [c["messages"] for c in json.loads(FIXTURE.read_text())["cases"]]
    num_blocks = max(args.streams * -(-(64 + args.tokens) // BLOCK_SIZE), 1024 // BLOCK_SIZE) + 8
    with tempfile.TemporaryDirectory() as tmp:
        setups = setups_for(names, path, folder, Path(tmp))
        report, engines = start_engines(setups, args.rounds, num_blocks)
        runs = alternate_rates(engines, conversations, args)
    print_report(report, runs, path.stat().st_size / 2**20)


def llama1b(args: argparse.Namespace) -> None:
    """Issue 28's model target: a random 1B Llama as GGUF Q8_0, Q4_0 and Q4_K_M
    against the same weights in bf16 (benches/quant_llama1b.py), tokens/s only."""
    models = write_models(args.quick)
    if args.quick:  # every file written, but one engine per writer: CI's time is short
        quantized = "Q4_K_M" if "Q4_K_M" in models else "Q4_0"
        models = {name: models[name] for name in ("bf16", quantized)}
    quantized = [name for name in models if name != "bf16"]
    for name in quantized:
        print(f"{models[name].name}: {describe(models[name])}", flush=True)
    # a distinct prompt per stream (no shared prefix to cache), the same for every setup
    rng = np.random.default_rng(0)
    prompt_len = 8 if args.quick else 32
    prompts = [
        {"prompt_token_ids": [1, *rng.integers(3, 32000, prompt_len - 1).tolist()]}
        for _ in range(args.streams)
    ]
    max_model_len = prompt_len + args.tokens
    num_blocks = args.streams * -(-max_model_len // BLOCK_SIZE) + 8
    # the GGUF engines as a user gets them (dtype auto) unless --gguf-dtype says otherwise
    print(f"GGUF engines: dtype {args.gguf_dtype}", flush=True)
    engines = {
        name: LLM(
            model=str(path),
            dtype="bfloat16" if name == "bf16" else args.gguf_dtype,
            num_kv_blocks=num_blocks,
            max_model_len=max_model_len,
        )
        for name, path in models.items()
    }
    runs = alternate_rates(engines, prompts, args)
    one = ", ".join(f"{n} >= {TARGETS[n][0]}" for n in quantized)
    many = ", ".join(f"{n} >= {TARGETS[n][1]}" for n in quantized)
    targets = {
        f"{kind} x{n}": one if n == 1 else many
        for kind in ("greedy", "sampled")
        for n in (1, args.streams)
    }
    print(f"\nrandom {QUICK if args.quick else FULL}, {prompt_len}-token prompts")
    print_rates(runs, targets)


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
    print_rates(runs)


def print_rates(
    runs: dict[str, list[dict[str, float]]], targets: dict[str, str] | None = None
) -> None:
    """The tokens/s table: per setup the median of its rounds and the median of its
    per-round ratios to bf16; `targets`, a last column, by row key."""
    keys = list(runs["bf16"][0])
    others = [name for name in runs if name != "bf16"]
    extra = ["target (/ bf16)"] if targets else []
    print("\n| tokens/s | bf16 | " + " | ".join([f"{n} (/ bf16)" for n in others] + extra) + " |")
    print("|---|---:|" + "---:|" * len(others) + "---|" * len(extra))
    for key in keys:
        base = [r[key] for r in runs["bf16"]]
        cells = []
        for name in others:
            got = [r[key] for r in runs[name]]
            ratio = median(x / y for x, y in zip(got, base, strict=True))
            cells.append(f"{median(got):.1f} ({ratio:.2f})")
        if targets:
            cells.append(targets[key])
        print(f"| {key} | {median(base):.1f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
