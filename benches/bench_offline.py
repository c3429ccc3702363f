"""Offline throughput: asyncllm's `LLM` against transformers `generate`, greedy and
sampled, and the engine's decode step against a bare plain-torch decode step (the
floor).

    python benches/bench_offline.py [--models micro small moe] [--streams 64 256] [--quick]

Workloads (fixed seed): "fixed" = `--streams` requests at once (64 and 256),
32-token prompts, 128 output tokens; "mixed" = 256 requests, prompts of 16-512
tokens, outputs of 16-256. Every output ignores EOS so all systems produce the same
number of tokens. Each row runs twice: greedy, and sampled (temperature 1.0,
top_p 0.95, as real clients sample), alternating in one loop so load hits both
alike; "sampled/greedy" is the median of the per-pair ratios (issue 11's target:
>= 0.95). transformers runs the same prompts in left-padded batches sorted by
length (batch 64), generating each batch's longest output; only requested tokens
count. `--overlap` adds the engine with overlap scheduling to the loop; its
"overlap/serial" is the median of the per-pair ratios. `--bf16` adds the engine in
bfloat16 (weights, activations and KV cache) to the loop; its "bf16/fp32" is the
median of the per-pair ratios against the float32 engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from floor import FloorDecode  # noqa: E402
from models import MODELS, QUICK_HELP, build_model  # noqa: E402

VOCAB = 32000


SAMPLING = {"greedy": dict(temperature=0.0), "sampled": dict(temperature=1.0, top_p=0.95)}


def workload(name: str, num: int, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    g = torch.Generator().manual_seed(seed)
    if name == "fixed":
        lens, outs = [32] * num, [128] * num
    else:
        lens = torch.randint(16, 513, (num,), generator=g).tolist()
        outs = torch.randint(16, 257, (num,), generator=g).tolist()
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]
    return prompts, outs


def run_engine(
    model_dir: Path,
    prompts,
    outs,
    sampling: str,
    async_scheduling: bool = False,
    dtype: str = "float32",
) -> dict:
    """The user's path: `LLM` with its engine core in its own process."""
    from asyncllm import LLM, SamplingParams

    with LLM(
        str(model_dir),
        dtype=dtype,
        max_num_seqs=256,
        max_num_batched_tokens=4096,
        async_scheduling=async_scheduling,
        collect_step_timings=True,  # the core's step timers, read below
    ) as llm:
        kw = SAMPLING[sampling]
        params = [SamplingParams(max_tokens=n, ignore_eos=True, **kw) for n in outs]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - t0
        timings = llm.engine.call_utility("get_step_timings")
    tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert tokens == sum(outs)
    # the core's own timers: steps that decoded all 256 requests at once
    full = [
        s + e + u
        for s, e, u, n in zip(
            timings["schedule"],
            timings["execute"],
            timings["update"],
            timings["num_outputs"],
            strict=True,
        )
        if n == len(prompts)
    ]
    return {
        "elapsed_s": elapsed,
        "tokens_per_s": tokens / elapsed,
        "decode_step_ms": 1e3 * median(full) if full else None,
    }


def decoding_core(model_dir: Path, context: int, steps_ahead: int) -> Any:
    """An in-process EngineCore with 256 requests decoding at `context` tokens, with
    room for `steps_ahead` more decode steps: the engine side of the floor checks."""
    from asyncllm import EngineArgs, SamplingParams
    from asyncllm.engine.core import build_engine_core
    from asyncllm.messages import EngineCoreRequest

    core = build_engine_core(
        EngineArgs(
            model=str(model_dir), dtype="float32", max_num_seqs=256, max_num_batched_tokens=8192
        )
    )
    prompts, _ = workload("fixed", 256, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=context + steps_ahead + 8, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(i, prompt[:32], params))
    core.step()  # the prefill
    while core.scheduler.running[0].num_tokens < context:
        core.step()
    return core


def paired_decode_vs_floor(model_dir: Path, context: int, repeats: int) -> dict:
    """The engine core's decode step at batch 256 (schedule, input preparation,
    forward, sampling, update, output columns: all that runs between two forward
    passes in the core process; detokenizing is the front-end process's work)
    against the floor, timed alternately in one loop so that load from elsewhere
    hits both alike."""
    core = decoding_core(model_dir, context, repeats)
    floor = FloorDecode(str(model_dir), 256, context + repeats // 2)
    floor.step()
    eng_t, floor_t = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        core.step()
        t1 = time.perf_counter()
        floor.step()
        t2 = time.perf_counter()
        eng_t.append(t1 - t0)
        floor_t.append(t2 - t1)
    assert all(r.num_output_tokens > 0 for r in core.scheduler.running)
    return {
        "engine_step_ms": 1e3 * median(eng_t),
        "floor_step_ms": 1e3 * median(floor_t),
        "step_over_floor": median(eng_t) / median(floor_t),
    }


@torch.inference_mode()
def run_transformers(model_dir: Path, prompts, outs, sampling: str, batch: int = 64) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if sampling == "greedy":
        kw: dict[str, Any] = dict(do_sample=False)
    else:  # top_k=0: generate's default of 50 would make it another workload
        kw = dict(do_sample=True, top_k=0, **SAMPLING[sampling])
    order = sorted(range(len(prompts)), key=lambda i: (outs[i], len(prompts[i])))
    t0 = time.perf_counter()
    for s in range(0, len(order), batch):
        idx = order[s : s + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros((len(idx), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, i in enumerate(idx):
            n = len(prompts[i])
            ids[row, width - n :] = torch.tensor(prompts[i])
            mask[row, width - n :] = 1
        new = max(outs[i] for i in idx)
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new,
            min_new_tokens=new,
            pad_token_id=0,
            **kw,
        )
    elapsed = time.perf_counter() - t0
    return {"elapsed_s": elapsed, "tokens_per_s": sum(outs) / elapsed}


def measure(
    model_dir: Path,
    prompts,
    outs,
    repeats: int,
    with_hf: bool,
    overlap: bool = False,
    bf16: bool = False,
) -> list[dict]:
    """Greedy and sampled rows of one workload: the engine (and transformers, and the
    engine with overlap scheduling) alternating in one loop, so that load from
    elsewhere hits every system alike."""
    runs: dict[str, dict[str, list[dict]]] = {
        k: {"eng": [], "hf": [], "overlap": [], "bf16": []} for k in SAMPLING
    }
    for _ in range(repeats):
        for sampling, r in runs.items():
            r["eng"].append(run_engine(model_dir, prompts, outs, sampling))
            if overlap:
                r["overlap"].append(run_engine(model_dir, prompts, outs, sampling, True))
            if bf16:
                r["bf16"].append(run_engine(model_dir, prompts, outs, sampling, dtype="bfloat16"))
            if with_hf:
                r["hf"].append(run_transformers(model_dir, prompts, outs, sampling))
    rows = []
    for sampling, r in runs.items():
        row: dict[str, Any] = {"sampling": sampling}
        row["engine_tok_s"] = median(x["tokens_per_s"] for x in r["eng"])
        if r["hf"]:
            row["hf_tok_s"] = median(x["tokens_per_s"] for x in r["hf"])
            pairs = zip(r["eng"], r["hf"], strict=True)
            row["ratio"] = median(e["tokens_per_s"] / h["tokens_per_s"] for e, h in pairs)
        if r["overlap"]:
            row["overlap_tok_s"] = median(x["tokens_per_s"] for x in r["overlap"])
            pairs = zip(r["overlap"], r["eng"], strict=True)
            row["overlap_over_serial"] = median(
                o["tokens_per_s"] / e["tokens_per_s"] for o, e in pairs
            )
        if r["bf16"]:
            row["bf16_tok_s"] = median(x["tokens_per_s"] for x in r["bf16"])
            pairs = zip(r["bf16"], r["eng"], strict=True)
            row["bf16_over_fp32"] = median(b["tokens_per_s"] / e["tokens_per_s"] for b, e in pairs)
        steps = [x["decode_step_ms"] for x in r["eng"] if x["decode_step_ms"]]
        if steps:
            row["decode_step_ms"] = median(steps)
        rows.append(row)
    rows[1]["sampled_over_greedy"] = median(
        s["tokens_per_s"] / g["tokens_per_s"]
        for s, g in zip(runs["sampled"]["eng"], runs["greedy"]["eng"], strict=True)
    )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["micro", "small"])
    ap.add_argument("--workloads", nargs="+", default=["fixed", "mixed"])
    ap.add_argument("--streams", nargs="+", type=int, default=[64, 256], help="fixed: requests")
    ap.add_argument("--num-requests", type=int, default=256, help="mixed: requests")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system; medians reported")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--overlap",
        action="store_true",
        help="also run the engine with overlap scheduling (async_scheduling), paired",
    )
    ap.add_argument("--bf16", action="store_true", help="also run the engine in bfloat16, paired")
    ap.add_argument("--skip-floor", action="store_true", help="no paired engine/floor steps")
    ap.add_argument("--floor-repeats", type=int, default=15, help="paired engine/floor steps")
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    context = 96  # the fixed workload decodes at 32..160 tokens of context: mean 96
    if args.quick:
        args.models, args.workloads, args.streams, args.num_requests = ["micro"], ["fixed"], [8], 8
        args.repeats, args.floor_repeats, context = 1, 3, 36
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in args.models:
            model_dir = build_model(model_name, Path(tmp))
            for wl in args.workloads:
                for streams in args.streams if wl == "fixed" else [args.num_requests]:
                    prompts, outs = workload(wl, streams)
                    if args.quick:
                        outs = [min(n, 8) for n in outs]
                    found = measure(
                        model_dir,
                        prompts,
                        outs,
                        args.repeats,
                        not args.skip_transformers,
                        args.overlap,
                        args.bf16,
                    )
                    for row in found:
                        row.update(model=model_name, workload=wl, streams=streams)
                    llama = MODELS[model_name].get("arch", "llama") == "llama"  # floor.py's
                    if (
                        wl == "fixed"
                        and streams == max(args.streams)
                        and llama
                        and not args.skip_floor
                    ):
                        found[0].update(
                            paired_decode_vs_floor(model_dir, context, args.floor_repeats)
                        )
                    for row in found:
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print()
    print(f"torch threads: {threads}; medians of {args.repeats} runs")
    print(
        "| model | workload | streams | sampling | asyncllm tok/s | transformers tok/s | ratio "
        "| sampled/greedy | overlap tok/s | overlap/serial | bf16 tok/s | bf16/fp32 "
        "| decode step ms (all streams, core timers) "
        "| paired: engine step ms | floor ms | engine/floor |"
    )
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:

        def f(key, fmt="{:.1f}", r=r):
            return fmt.format(r[key]) if key in r else "–"

        print(
            f"| {r['model']} | {r['workload']} | {r['streams']} | {r['sampling']} | "
            f"{f('engine_tok_s')} | {f('hf_tok_s')} | {f('ratio', '{:.2f}×')} | "
            f"{f('sampled_over_greedy', '{:.3f}')} | {f('overlap_tok_s')} | "
            f"{f('overlap_over_serial', '{:.3f}')} | {f('bf16_tok_s')} | "
            f"{f('bf16_over_fp32', '{:.2f}')} | {f('decode_step_ms', '{:.2f}')} | "
            f"{f('engine_step_ms', '{:.2f}')} | "
            f"{f('floor_step_ms', '{:.2f}')} | {f('step_over_floor', '{:.3f}')} |"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
