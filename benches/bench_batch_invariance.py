"""Batch invariance: how often the fast default's output for a prompt changes with the
rows beside it, and what the batch-invariant mode costs.

    python benches/bench_batch_invariance.py [--model small] [--dtypes float32 bfloat16]
        [--prompts 32] [--tokens 32] [--quick]

For each dtype and mode (default kernels; `batch_invariant=True`), every prompt is
generated once alone and once inside a batch of all prompts (greedy, logprobs of the
chosen tokens, and sampled with a per-request seed: temperature 1.0, top_p 0.95).
Reported: the share of prompts whose tokens differ between the two runs, the share of
logprob values that are not bit-identical, and the batch's tokens/s in each mode (its
ratio: the mode's cost). The batch-invariant rows must read 0 differences.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import QUICK_HELP, build_model  # noqa: E402

from asyncllm import LLM, SamplingParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], tokens: int, sampled: bool) -> tuple[list, float]:
    kw = dict(temperature=1.0, top_p=0.95) if sampled else dict(temperature=0.0)
    params = [
        SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0, seed=i, **kw)
        for i in range(len(prompts))
    ]
    alone = [
        llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in zip(prompts, params, strict=True)
    ]
    start = time.perf_counter()
    batch = llm.generate(prompts, params, use_tqdm=False)
    tps = len(prompts) * tokens / (time.perf_counter() - start)
    return list(zip(alone, batch, strict=True)), tps


def differences(pairs: list) -> tuple[float, float]:
    """(share of prompts whose tokens differ, share of logprobs not bit-identical)."""
    token_diff = lp_diff = lp_total = 0
    for a, b in pairs:
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        token_diff += list(ta) != list(tb)
        for la, lb in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            va = next(iter(la.values())).logprob
            vb = next(iter(lb.values())).logprob
            lp_total += 1
            lp_diff += va != vb
    return token_diff / len(pairs), lp_diff / max(lp_total, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    if args.quick:
        args.model, args.dtypes, args.prompts, args.tokens = "micro", ["float32"], 4, 4
    import random

    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 32000) for _ in range(rng.randrange(8, 96))] for _ in range(args.prompts)
    ]
    print(
        "| dtype | mode | sampling | prompts whose tokens differ | logprobs not identical "
        "| batch tok/s |"
    )
    print("|---|---|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(args.model, Path(args.model_dir or tmp))
        for dtype in args.dtypes:
            for invariant in (False, True):
                with LLM(str(model), dtype=dtype, batch_invariant=invariant) as llm:
                    for sampled in (False, True):
                        pairs, tps = run(llm, prompts, args.tokens, sampled)
                        tok, lp = differences(pairs)
                        mode = "batch_invariant" if invariant else "default"
                        name = "sampled" if sampled else "greedy"
                        print(f"| {dtype} | {mode} | {name} | {tok:.0%} | {lp:.0%} | {tps:.0f} |")
                        sys.stdout.flush()


if __name__ == "__main__":
    main()
