"""Multi-LoRA serving against the base model, on the random-weight "small" model
(benches/models.py: hidden 512, 8 layers) with rank-16 PEFT adapters on every
projection (q/k/v/o/gate/up/down), in one engine with LoRA on.

    python benches/bench_lora.py [--rounds 5] [--tokens 64] [--kernel auto|rust|torch]
    python benches/bench_lora.py --kernels [--rounds 9]
    python benches/bench_lora.py --load-only
    python benches/bench_lora.py --quick        # 1 round of 8 tokens (CI)

Each round alternates, in one engine: base rows vs adapter rows for
- 64 streams: all on the base model / spread over 8 adapters (8 streams each);
- batch 1: one stream without / with an adapter;
greedy (temperature 0) and sampled (temperature 1.0, top_p 0.95, a seed per
request) rows; tokens/s per run, medians of the per-round ratios. Also: the time
to read a rank-16 adapter into the host's cache (`HostAdapters.read`, median of
10) and to write adapters into the device slots (`DeviceSlots.acquire`, on the
busy loop: first writes into a fresh engine's slots, and later ones), beside the
time of a decode step (a switch should cost at most about one step).

`--kernels` times the two LoRA kernels alone (lora.kernel: the rust one and the
torch one) on the small model's projections at 64 tokens over 8 rank-16 adapters
and at 1 token, alternated round by round, medians in microseconds per call.

The issue's targets: 64 streams over 8 adapters >= 0.85x the base model's tokens/s;
batch-1 with an adapter >= 0.9x without; loading a rank-16 adapter < 50 ms.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from functools import partial
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


def load_times(llm: LLM, loras: list[LoRARequest]) -> dict[str, list[float]]:
    """Milliseconds to read an adapter into the host's cache (read, check and lay
    out for the slots: `HostAdapters.read`, 10 times), and to write adapters into
    the device slots (`DeviceSlots.acquire`, on the busy loop in an engine): first
    into each slot of a fresh engine ("first"), then rewriting every slot with
    another adapter, three times ("later")."""
    model = llm.engine.core.runner.lora
    times: dict[str, list[float]] = {"read": [], "first": [], "later": []}
    for _ in range(10):
        t0 = time.perf_counter()
        model.host.read(loras[0])
        times["read"].append((time.perf_counter() - t0) * 1e3)
    for phase in ("first", "later", "later", "later"):
        adapters = [model.host.read(lora) for lora in loras]  # new objects: rewrites
        slots = []
        for adapter in adapters:
            t0 = time.perf_counter()
            slots.append(model.slots.acquire(adapter))
            times[phase].append((time.perf_counter() - t0) * 1e3)
        for slot in slots:
            model.slots.release(slot)
    return times


def print_load_times(times: dict[str, list[float]], step_ms: dict[str, float]) -> None:
    print(
        f"\nrank-16 adapter: read + check + lay out {median(times['read']):.1f} ms (median "
        f"of 10); write into a slot: first {median(times['first']):.2f} ms (median of 8, max "
        f"{max(times['first']):.2f}), later {median(times['later']):.2f} ms (median of 24, "
        f"max {max(times['later']):.2f})"
    )
    for case, ms in step_ms.items():
        print(f"a decode step, {case} with adapters: {ms:.2f} ms (from its tokens/s)")


# (name, k, fused projections' outputs) of the small model's adapted layers
LAYERS = (
    ("qkv", 512, [512, 256, 256]),
    ("o", 512, [512]),
    ("gate_up", 512, [1536, 1536]),
    ("down", 1536, [512]),
)


def rust_on_copy(rust: partial, y: torch.Tensor) -> None:
    """The rust kernel adds into its output: a fresh copy each call, as a layer's."""
    rust.func(y.clone(), *rust.args[1:])


def bench_kernels(rounds: int) -> None:
    """Rust vs torch LoRA kernel per layer shape and token count (µs per call); and
    the rust one told the layer is one projection ("whole rows": its expand walks
    every row of B across all outputs, zero blocks included, as before it took
    the fused parts)."""
    import numpy as np

    from asyncllm.lora.kernel import lora_add_rust, lora_add_torch
    from asyncllm.models.linear_kernels import as_buffer

    threads = torch.get_num_threads()
    print("\n| layer | tokens | rust µs | rust, whole rows µs | torch µs | rust / torch |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, k, parts in LAYERS:
        width, n = len(parts) * 16, sum(parts)
        a = torch.randn(8, k, width) * 0.01
        b = torch.randn(8, width, n) * 0.01
        a_buf, b_buf = as_buffer(a.view(-1, width)), as_buffer(b.view(-1, n))
        for tokens in (64, 1):
            x, y = torch.randn(tokens, k), torch.randn(tokens, n)
            slots = np.arange(tokens, dtype=np.int64) % 8
            order = torch.from_numpy(np.argsort(slots, kind="stable"))
            ordered = slots[order.numpy()]
            segs = tuple(
                (s, int(np.searchsorted(ordered, s)), int(np.searchsorted(ordered, s, "right")))
                for s in sorted(set(slots.tolist()))
            )
            single = 0 if tokens == 1 else None
            ranks = np.full(8, 16, dtype=np.int64)  # rank-16 adapters in every slot: no padding
            rust = partial(lora_add_rust, y, x, a_buf, b_buf, slots, parts, ranks, threads)
            whole = partial(
                lora_add_rust, y, x, a_buf, b_buf, slots, [n], ranks * len(parts), threads
            )
            fns = {
                "rust": lambda rust=rust, y=y: rust_on_copy(rust, y),
                "whole": lambda whole=whole, y=y: rust_on_copy(whole, y),
                "torch": partial(lora_add_torch, y, x, a, b, single, order, segs),
            }
            times: dict[str, list[float]] = {kind: [] for kind in fns}
            for _ in range(rounds):
                for kind, fn in fns.items():
                    fn()
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn()
                    times[kind].append((time.perf_counter() - t0) / 20 * 1e6)
            r, w, t = (median(times[kind]) for kind in ("rust", "whole", "torch"))
            print(f"| {name} | {tokens} | {r:.1f} | {w:.1f} | {t:.1f} | {r / t:.2f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--kernel", default="auto", help="LoRA kernel: auto, rust or torch")
    ap.add_argument("--kernels", action="store_true", help="time the two kernels alone")
    ap.add_argument("--load-only", action="store_true", help="only the adapter load time")
    ap.add_argument("--quick", action="store_true", help="1 round of 8 tokens")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens = 1, 8
    if args.kernels:
        print(machine_header(), f"torch threads {torch.get_num_threads()}", flush=True)
        bench_kernels(args.rounds)
        return
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
    times = load_times(llm, loras)  # "first": the engine's slots never written yet
    if args.load_only:
        rate(llm, 64, loras, "greedy", 8)  # warm up
        steps = {"64 streams": 64 / rate(llm, 64, loras, "greedy", args.tokens),
                 "batch 1": 1 / rate(llm, 1, loras[:1], "greedy", args.tokens)}  # fmt: skip
        llm.shutdown()
        print_load_times(times, {case: s * 1e3 for case, s in steps.items()})
        return
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
    llm.shutdown()
    print("\n| case | sampling | base tok/s | adapters tok/s | adapters / base |")
    print("|---|---|---:|---:|---:|")
    for (case, kind), rs in ratios.items():
        b, a = median(rates[(case, kind, "base")]), median(rates[(case, kind, "lora")])
        print(f"| {case} | {kind} | {b:.1f} | {a:.1f} | {median(rs):.3f} |")
    steps = {
        case: median(streams / a for a in rates[(case, "greedy", "lora")])
        for case, streams in (("64 streams", 64), ("batch 1", 1))
    }
    print_load_times(times, {case: s * 1e3 for case, s in steps.items()})


if __name__ == "__main__":
    main()
