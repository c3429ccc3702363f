"""Embeddings: `LLM.embed` against transformers' forward on the same prompts, and
against a prefill-only generation run (max_tokens=1) of the same engine.

    python benches/bench_embed.py [--model small] [--num-prompts 64] [--rounds 3] [--quick]

Each round runs, in turn, the engine's `embed` (last-token pooling, normalized),
the engine's `generate` with one output token (the prompt work of a generation
run), and transformers: the model's final hidden states over right-padded
batches of length-sorted prompts, each row's last token normalized (what a user
of transformers writes). Reported: embeddings/s and prompt tokens/s of each, their
medians over the rounds, and the medians of the per-round ratios (issue 30's
target: embed >= 0.9x the prompt tokens/s of prefill-only generation).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import QUICK_HELP, build_model  # noqa: E402

VOCAB = 32000


def workload(num: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(64, 257, (num,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]


def time_embed(llm, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    outs = llm.embed(prompts, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    assert len(outs) == len(prompts) and all(o.outputs.embedding for o in outs)
    return elapsed


def time_prefill(llm, prompts: list[list[int]]) -> float:
    from asyncllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def time_transformers(model, prompts: list[list[int]], batch: int) -> float:
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    t0 = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, len(order), batch):
            idx = order[s : s + batch]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.zeros((len(idx), width), dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, i in enumerate(idx):
                ids[row, : len(prompts[i])] = torch.tensor(prompts[i])
                mask[row, : len(prompts[i])] = 1
            hidden = model.model(ids, attention_mask=mask).last_hidden_state
            last = hidden[torch.arange(len(idx)), mask.sum(1) - 1]
            torch.nn.functional.normalize(last, dim=-1)
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="small")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = p.parse_args()
    if args.quick:
        args.model, args.num_prompts, args.rounds = "micro", 8, 1
    from transformers import AutoModelForCausalLM

    from asyncllm import LLM

    prompts = workload(args.num_prompts)
    num_tokens = sum(map(len, prompts))
    times: dict[str, list[float]] = {"embed": [], "prefill": [], "transformers": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(args.model, Path(tmp))
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        with LLM(str(model_dir), dtype="float32", max_num_batched_tokens=4096) as llm:
            time_embed(llm, prompts[:4])  # warm both paths once
            time_prefill(llm, prompts[:4])
            for _ in range(args.rounds):
                llm.engine.call_utility("reset_prefix_cache")
                times["embed"].append(time_embed(llm, prompts))
                llm.engine.call_utility("reset_prefix_cache")
                times["prefill"].append(time_prefill(llm, prompts))
                times["transformers"].append(time_transformers(hf, prompts, args.hf_batch))
    load = os.getloadavg()
    print(
        f"model {args.model}, {len(prompts)} prompts of 64-256 tokens ({num_tokens} tokens), "
        f"{args.rounds} rounds, torch threads here {torch.get_num_threads()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print("| run | embeddings/s (median) | prompt tokens/s (median) | per round (s) |")
    print("|---|---|---|---|")
    for name, ts in times.items():
        m = statistics.median(ts)
        rounds = ", ".join(f"{t:.2f}" for t in ts)
        print(f"| {name} | {len(prompts) / m:.1f} | {num_tokens / m:.0f} | {rounds} |")
    for name in ("prefill", "transformers"):
        ratios = [o / e for e, o in zip(times["embed"], times[name], strict=True)]
        ratio = statistics.median(ratios)
        print(f"embed / {name} throughput, median of per-round ratios: {ratio:.2f}")


if __name__ == "__main__":
    main()
