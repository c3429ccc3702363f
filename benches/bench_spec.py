"""Speculative decoding (n-gram prompt lookup, SuffixDecoding) against none, on
SmolLM2-135M-Instruct (its GGUF, Q4_1): tokens/s and acceptance on an editing
workload, where the answer copies most of the prompt; on a common-answer workload,
where requests ask the same question in other words and the answers repeat each
other more than their prompts; and on open-ended chat, where nothing is there to
copy.

    python benches/bench_spec.py [--rounds 3] [--tokens 96] [--streams 1,16] [--k 8]
                                 [--weights gguf|bf16] [--methods ngram,suffix]
                                 [--workloads editing,common answer,open chat]

The engines (off and one per method) are started once and alternate round by round;
each round runs every workload at each stream count, greedy (temperature 0) and
sampled (temperature 0.7, top_p 0.95, a seed per request and round: each round draws
other samples, so a sampled row's median spans several draws of each prompt),
`--tokens` new tokens per request. Reported: the median tokens/s of each engine, the
median of the per-round ratios on / off, the share of tokens identical to decoding
without speculation (first round), greedy and seeded (the default mode, not batch-
invariant: a k + 1-row forward may round differently), the acceptance rate (accepted
/ proposed draft tokens), the mean accepted length (1 + accepted per draft) and the
acceptance per draft position. Every engine is warmed up first (`--tokens` tokens at
each stream count, on a prompt unlike the workloads'). The suffix engine starts
afresh (and is warmed up) for every cell (workload, streams, sampling, round): its
shared outputs are those of the cell's own requests and the warm-up's, never the
same prompt's answer from an earlier cell. Prefix caching is off in every engine, so
each computes every prompt the same way (whole) whatever ran before.

The issue's targets: editing >= 2.0x at 1 stream and >= 1.3x at 16; open-ended
chat >= 0.97x at both.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median
from tempfile import mkdtemp
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tools"))
from bench_roofline import machine_header  # noqa: E402
from fetch_smollm2 import fetch  # noqa: E402

from asyncllm import LLM, SamplingParams  # noqa: E402

CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. "
    "Visitors may borrow up to five books at a time for three weeks. Books that are "
    "returned late cost ten cents a day. The reading room on the second floor is quiet "
    "and has free wifi for everyone with a library card."
)
EDIT = [
    f"Rewrite this function renaming the variable subtotal to base_amount. Reply with "
    f"the code only.\n\n{CODE}",
    f"Copy this paragraph, replacing 'library' with 'museum'.\n\n{PARAGRAPH}",
    f"Add a docstring to this function and return the whole function.\n\n{CODE}",
]
CHAT = [
    "Give me three ideas for a weekend trip in the mountains.",
    "Why is the sky blue? Explain it to a child.",
    "Write a short poem about autumn leaves.",
]
COMMON = [
    "How do I reset my password? Answer in three short steps.",
    "I forgot my password. How do I reset it? Answer in three short steps.",
    "Please tell me how to reset my password, in three short steps.",
]
WORKLOADS = {"editing": EDIT, "common answer": COMMON, "open chat": CHAT}
SPEC_KEYS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def params(kind: str, tokens: int, seed: int) -> SamplingParams:
    if kind == "greedy":
        return SamplingParams(max_tokens=tokens, temperature=0)
    return SamplingParams(max_tokens=tokens, temperature=0.7, top_p=0.95, seed=seed)


def run(
    llm: LLM, prompts: list[str], kind: str, tokens: int, streams: int, first_seed: int = 0
) -> tuple[float, list]:
    """Tokens/s over the prompts, `streams` requests at a time (each prompt repeated
    to fill them), and the token ids; sampled requests are seeded from `first_seed`."""
    chats = [[{"role": "user", "content": p}] for p in prompts]
    generated = 0
    ids = []
    t0 = time.perf_counter()
    if streams == 1:
        for i, chat in enumerate(chats):
            out = llm.chat([chat], params(kind, tokens, first_seed + i), use_tqdm=False)[0]
            generated += len(out.outputs[0].token_ids)
            ids.append(list(out.outputs[0].token_ids))
    else:
        batch = [chats[i % len(chats)] for i in range(streams)]
        ps = [params(kind, tokens, first_seed + i) for i in range(streams)]
        outs = llm.chat(batch, ps, use_tqdm=False)
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        ids = [list(o.outputs[0].token_ids) for o in outs]
    return generated / (time.perf_counter() - t0), ids


def spec_stats(llm: LLM) -> dict[str, Any]:
    stats: Any = llm.engine.call_utility("get_stats")
    return {k: v for k, v in stats.items() if k.startswith("spec_decode")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument(
        "--weights",
        choices=("gguf", "bf16"),
        default="gguf",
        help="the GGUF (Q4_1) or its weights dequantized to bf16",
    )
    ap.add_argument(
        "--dtype",
        default="auto",
        help="activations of the GGUF: auto (what a user gets: bfloat16 on a CPU with "
        "AVX512-BF16, else float32) or float32",
    )
    ap.add_argument(
        "--methods",
        default="ngram,suffix",
        help="comma-separated methods; NAME-fixed verifies every draft (no adaptive budget)",
    )
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated")
    ap.add_argument("--quick", action="store_true", help="1 round, 16 tokens, 1 stream")
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.tokens, args.streams = 1, 16, "1"
    streams = [int(s) for s in args.streams.split(",")]
    print(
        machine_header(), f"torch threads {torch.get_num_threads()}, dtype {args.dtype}", flush=True
    )
    path = str(fetch())
    dtype = args.dtype
    if args.weights == "bf16":
        from bench_quant import dense_checkpoint

        from asyncllm.gguf_files import prepare_gguf

        path, dtype = str(dense_checkpoint(prepare_gguf(Path(path)), Path(mkdtemp()))), "bfloat16"
    # No prefix caching: the suffix engine restarts for every cell while the others
    # would find each prompt cached from the cell before, so they would prefill only
    # its last token (a 1-row forward: the integer kernel) where the fresh engine
    # prefills the whole prompt (the float tiles) - different rounding at the first
    # token, counted as speculation's, and a prefill only the suffix engine pays.
    common = {
        "model": path,
        "dtype": dtype,
        "max_model_len": 1024,
        "max_num_seqs": 32,
        "enable_prefix_caching": False,
    }
    methods = args.methods.split(",")

    def start(method: str) -> LLM:
        """An engine, warmed up (its first steps pay one-off costs) at every stream
        count on a prompt unlike the workloads'."""
        spec = None if method == "off" else spec_config(method, args.k)
        llm = LLM(**common, speculative_config=spec)
        warm = SamplingParams(max_tokens=args.tokens, temperature=0)
        for n in streams:
            llm.generate(["Count from one to thirty in words."] * n, warm, use_tqdm=False)
        return llm

    engines = {m: start(m) for m in ["off", *methods]}
    workloads = {w: WORKLOADS[w] for w in args.workloads.split(",")}
    first = (0, next(iter(workloads)), streams[0], "greedy")
    rates: dict[tuple[str, int, str], dict[str, list[float]]] = {}
    same: dict[tuple[str, int, str, str], list[int]] = {}
    accept: dict[tuple[str, int, str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        for name, prompts in workloads.items():
            for n in streams:
                for kind in ("greedy", "sampled"):
                    key = (name, n, kind)
                    got = {}
                    for m in [m for m in engines if m.startswith("suffix")]:
                        if (r, name, n, kind) != first:
                            engines[m].shutdown()
                            engines[m] = start(m)
                    for engine, llm in engines.items():
                        before = spec_stats(llm) if engine != "off" else {}
                        seed = r * max(n, len(prompts))  # each round its own draws
                        rate, ids = run(llm, prompts, kind, args.tokens, n, seed)
                        rates.setdefault(key, {}).setdefault(engine, []).append(rate)
                        got[engine] = ids
                        if engine != "off":
                            accept.setdefault((*key, engine), []).append(
                                delta(before, spec_stats(llm))
                            )
                    if r == 0:
                        for m in methods:
                            same[(*key, m)] = identical(got["off"], got[m])
                    print(r, key, {e: f"{v[-1]:.1f}" for e, v in rates[key].items()}, flush=True)
    for llm in engines.values():
        llm.shutdown()
    report(rates, accept, same, methods)


def spec_config(method: str, k: int) -> dict[str, Any]:
    """The configuration of `method`; "NAME-fixed" verifies every draft (without
    the adaptive draft budget)."""
    name, _, fixed = method.partition("-")
    spec: dict[str, Any] = {"method": name, "num_speculative_tokens": k}
    if name == "ngram":
        spec |= {"prompt_lookup_min": 2, "prompt_lookup_max": 5}
    if fixed:
        spec["adaptive_drafts"] = False
    return spec


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    out = {k: after[k] - before.get(k, 0) for k in SPEC_KEYS}
    pos_b = before.get("spec_decode_num_accepted_tokens_per_pos") or []
    pos_a = after["spec_decode_num_accepted_tokens_per_pos"]
    out["per_pos"] = [a - (pos_b[i] if i < len(pos_b) else 0) for i, a in enumerate(pos_a)]
    return out


def identical(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """[tokens identical up to the first difference, tokens] over the requests."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += max(len(x), len(y))
        same += next(
            (i for i, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y))
        )
    return [same, total]


def report(
    rates: dict[tuple[str, int, str], dict[str, list[float]]],
    accept: dict[tuple[str, int, str, str], list[dict[str, Any]]],
    same: dict[tuple[str, int, str, str], list[int]],
    methods: list[str],
) -> None:
    print(
        "\n| workload | streams | sampling | method | off tok/s | on tok/s | on / off "
        "| acceptance | mean accepted length | accepted per position | identical tokens |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---|---:|")
    for (name, n, kind), by in rates.items():
        for m in methods:
            off, on = by["off"], by[m]
            ratio = median(b / a for a, b in zip(off, on, strict=True))
            acc = accept[(name, n, kind, m)]
            drafts = sum(a["spec_decode_num_drafts"] for a in acc)
            proposed = sum(a["spec_decode_num_draft_tokens"] for a in acc)
            accepted = sum(a["spec_decode_num_accepted_tokens"] for a in acc)
            per_pos = [sum(a["per_pos"][i] for a in acc) for i in range(len(acc[0]["per_pos"]))]
            rate = accepted / proposed if proposed else 0.0
            mean_len = 1 + accepted / drafts if drafts else 1.0
            pos = " ".join(f"{p / drafts:.2f}" if drafts else "-" for p in per_pos)
            s, t = same[(name, n, kind, m)]
            print(
                f"| {name} | {n} | {kind} | {m} | {median(off):.1f} | {median(on):.1f} "
                f"| {ratio:.2f} | {rate:.2f} | {mean_len:.2f} | {pos} | {s / t:.3f} |"
            )


if __name__ == "__main__":
    main()
