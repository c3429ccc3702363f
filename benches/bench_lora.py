"""Multi-LoRA serving against the base model, on the random-weight "small" model
(benches/models.py: hidden 512, 8 layers) with rank-16 PEFT adapters on every
projection (q/k/v/o/gate/up/down), in one engine with LoRA on.

    python benches/bench_lora.py [--rounds 5] [--tokens 64] [--kernel auto|rust|torch]

Each round alternates, in one engine: base rows vs adapter rows for
- 64 streams: all on the base model / spread over 8 adapters (8 streams each);
- batch 1: one stream without / with an adapter;
greedy (temperature 0) and sampled (temperature 1.0, top_p 0.95, a seed per
request) rows; tokens/s per run, medians of the per-round ratios. Also: the time
to read a rank-16 adapter into the host's cache (`HostAdapters.read`, median of
10) and to write it into a device slot (`DeviceSlots.acquire`).

The issue's targets: 64 streams over 8 adapters >= 0.85x the base model's tokens/s;
batch-1 with an adapter >= 0.9x without; loading a rank-16 adapter < 50 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench_roofline import machine_header  # noqa: E402
from lora_adapters import ALL_TARGETS, make_adapter  # noqa: E402
from models import build_model  # noqa: E402

from asyncllm import LLM, LoRARequest, SamplingParams  # noqa: E402

PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203]


def params(kind: str, tokens: int, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return SamplingParams(
        max_tokens=tokens, temperature=1.0, top_p=0.95, seed=seed, ignore_eos=True
    )


def rate(llm: LLM, streams: int, loras: list[LoRARequest | None], kind: str, tokens: int) -> float:
    """Generated tokens/s of `streams` requests, request i under loras[i % len]."""
    prompts = [{"prompt_token_ids": PROMPT} for _ in range(streams)]
    ps = [params(kind, tokens, i) for i in range(streams)]
    per = [loras[i % len(loras)] for i in range(streams)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, ps, use_tqdm=False, lora_request=per)  # type: ignore[arg-type]
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return n / (time.perf_counter() - t0)


def load_times(llm: LLM, lora: LoRARequest) -> tuple[float, float]:
    """(median ms to read + check the adapter, ms to write it into a free slot)."""
    model = llm.engine.core.runner.lora
    reads = []
    for _ in range(10):
        t0 = time.perf_counter()
        adapter = model.host.read(lora)
        reads.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    slot = model.slots.acquire(adapter)
    write = time.perf_counter() - t0
    model.slots.release(slot)
    return median(reads) * 1e3, write * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kernel", default="auto", help="LoRA kernel: auto, rust or torch")
    args = ap.parse_args()
    os.environ["ASYNCLLM_LORA_KERNEL"] = args.kernel
    print(machine_header(), f"torch threads {torch.get_num_threads()}", flush=True)
    root = Path(tempfile.mkdtemp())
    model = build_model("small", root)
    loras = [
        LoRARequest(f"a{i}", i + 1, str(make_adapter(model, root / f"a{i}", seed=i, r=16,
                                                       targets=ALL_TARGETS)))
        for i in range(8)
    ]  # fmt: skip
    llm = LLM(str(model), multiprocess=False, dtype="float32", enable_lora=True, max_loras=8,
              max_lora_rank=16, max_num_seqs=64)  # fmt: skip
    cases = {
        "64 streams": (64, [None], loras),
        "batch 1": (1, [None], [loras[0]]),
    }
    ratios: dict[tuple[str, str], list[float]] = {}
    rates: dict[tuple[str, str, str], list[float]] = {}
    rate(llm, 8, [None, *loras], "greedy", 8)  # warm up: every slot written
    for r in range(args.rounds):
        for case, (streams, base, adapted) in cases.items():
            for kind in ("greedy", "sampled"):
                b = rate(llm, streams, base, kind, args.tokens)
                a = rate(llm, streams, adapted, kind, args.tokens)
                rates.setdefault((case, kind, "base"), []).append(b)
                rates.setdefault((case, kind, "lora"), []).append(a)
                ratios.setdefault((case, kind), []).append(a / b)
                print(r, case, kind, f"base {b:.1f} lora {a:.1f} tok/s", flush=True)
    read_ms, write_ms = load_times(llm, LoRARequest("fresh", 99, loras[0].lora_path))
    llm.shutdown()
    print("\n| case | sampling | base tok/s | adapters tok/s | adapters / base |")
    print("|---|---|---:|---:|---:|")
    for (case, kind), rs in ratios.items():
        b, a = median(rates[(case, kind, "base")]), median(rates[(case, kind, "lora")])
        print(f"| {case} | {kind} | {b:.1f} | {a:.1f} | {median(rs):.3f} |")
    print(f"\nrank-16 adapter: read + check {read_ms:.1f} ms, write into a slot {write_ms:.1f} ms")


if __name__ == "__main__":
    main()
