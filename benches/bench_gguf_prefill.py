"""A GGUF model's prompt (time to first token) with the fused call and with the
torch path: on the CPU a prompt's tokens attend token-wise, so up to
`fused_decode.GGUF_MAX_TOKENS` tokens the one extension call takes them as it
takes decodes (asyncllm.models.fused_decode).

    python benches/bench_gguf_prefill.py [--lengths 20 110 250 512] [--rounds 8] [--quick]

SmolLM2-135M-Instruct Q4_1 (tools/fetch_smollm2.py), two in-process `LLM`s, one
with `fused_decode` off; each generates one token after a prompt of random token
ids, greedy and sampled (temperature 1.0, top_p 0.95), the two alternating round by
round so load from elsewhere hits both alike. Per length: the median time of each,
the median of the per-round ratios (fused / torch), and whether the first token and
its logprob agree (the same kernels on both paths: they should).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))
from bench_roofline import machine_header  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402

from asyncllm import LLM, SamplingParams  # noqa: E402
from asyncllm.models.fused_decode import GGUF_MAX_TOKENS  # noqa: E402


def first_token(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[float, tuple]:
    """Seconds to generate one token after `prompt`, and (token, its logprob)."""
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - t0
    token = out.token_ids[0]
    logprob = out.logprobs[0][token].logprob if out.logprobs else None
    return seconds, (token, logprob)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[20, 110, 250, 512])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="2 rounds, lengths 20 and 110")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.lengths = 2, [20, 110]
    print(machine_header(), f"(fused up to {GGUF_MAX_TOKENS} tokens)", flush=True)
    path = str(fetch())
    engines = {
        name: LLM(path, multiprocess=False, enable_prefix_caching=False, fused_decode=fused)
        for name, fused in (("fused", True), ("torch", False))
    }
    kinds = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=1, logprobs=1),
        "sampled": SamplingParams(temperature=1.0, top_p=0.95, seed=0, max_tokens=1, logprobs=1),
    }
    rng = np.random.default_rng(0)
    print("| prompt tokens | sampling | fused ms | torch path ms | fused / torch | same token |")
    print("|---:|---|---:|---:|---:|---|")
    for length in args.lengths:
        prompt = [int(t) for t in rng.integers(100, 40000, length)]
        for kind, params in kinds.items():
            times: dict[str, list[float]] = {name: [] for name in engines}
            firsts = {}
            for llm in engines.values():  # warm: the first prompt of a length pays once
                first_token(llm, prompt, params)
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    seconds, firsts[name] = first_token(llm, prompt, params)
                    times[name].append(seconds)
            ratio = median(f / t for f, t in zip(times["fused"], times["torch"], strict=True))
            same = firsts["fused"] == firsts["torch"]
            print(
                f"| {length} | {kind} | {1e3 * median(times['fused']):.1f} "
                f"| {1e3 * median(times['torch']):.1f} | {ratio:.2f} | {same} |",
                flush=True,
            )
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
