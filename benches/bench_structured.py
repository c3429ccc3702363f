"""Constrained decoding: what the allowed-token masks cost per step, against
xgrammar computing the same kind of masks, and what constraints cost a whole
engine.

    python benches/bench_structured.py [--steps 64] [--repeats 5] [--pairs 10] [--quick]

1. Masks alone (the llama-2 tokenizer, vocabulary 32,000): 64 and 256 streams,
   all one JSON schema or the 30 test schemas mixed; per step one batched fill of
   every stream's bitmask (asyncllm: `GrammarCompiler.fill_bitmasks`, llguidance,
   GIL released, serially on the calling thread as the engine runs it on a small
   machine, and on a pool of 2 threads; xgrammar: `BatchGrammarMatcher`), then each
   stream takes a random allowed token (its own draw) and advances. Reported: the
   median over steps of the fill, in µs per step, and of the advance.
2. The engine (the micro model, benches/models.py): tokens/s of 64 streams under
   a JSON schema that runs to max_tokens against 64 unconstrained streams, in
   alternating pairs (per pair, and the median decode step over all pairs: a
   pair lasts about a second, and this box's noise moves single pairs by ±15 %),
   and the time the extension's grammar thread spends per step on the last
   step's advance and the next step's masks (filled ahead, right after the draw).
3. Compile time of the 30 test schemas (p50, p99), fresh compiler cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from models import ASSETS, QUICK_HELP, build_model  # noqa: E402
from structured_cases import SCHEMAS  # noqa: E402

from asyncllm import _core  # noqa: E402

VOCAB = 32_000
EOS = 2
ONE_SCHEMA = SCHEMAS[1]


def pick(row: np.ndarray, rng: np.random.Generator, vocab: int) -> int:
    """A random token whose bit is set in `row` (int32 words)."""
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")[:vocab]
    allowed = np.flatnonzero(bits)
    return int(rng.choice(allowed)) if len(allowed) else EOS


def run_llguidance(compiler, schemas, n: int, steps: int, seed: int = 0, threads: int = 1):
    grammars = [compiler.compile("json", json.dumps(s)) for s in schemas]
    matchers = [grammars[i % len(grammars)].matcher() for i in range(n)]
    out = np.zeros((n, compiler.words), dtype=np.int32)
    rows = list(range(n))
    rng = np.random.default_rng(seed)
    fill, adv = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        compiler.fill_bitmasks(matchers, out, rows, threads)
        t1 = time.perf_counter()
        tokens = [pick(out[i], rng, VOCAB) for i in range(n)]
        t2 = time.perf_counter()
        status = compiler.advance(matchers, tokens)
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        adv.append(t3 - t2)
        for i, s in enumerate(status):  # finished streams start over
            if s != _core.GRAMMAR_RUNNING:
                matchers[i] = grammars[i % len(grammars)].matcher()
    return statistics.median(fill) * 1e6, statistics.median(adv) * 1e6


def run_xgrammar(xgr, info, schemas, n: int, steps: int, seed: int = 0):
    compiler = xgr.GrammarCompiler(info)
    compiled = [compiler.compile_json_schema(json.dumps(s), any_whitespace=False) for s in schemas]
    matchers = [xgr.GrammarMatcher(compiled[i % len(compiled)]) for i in range(n)]
    batch = xgr.BatchGrammarMatcher()
    bitmask = xgr.allocate_token_bitmask(n, info.vocab_size)
    rng = np.random.default_rng(seed)
    fill, adv = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        t1 = time.perf_counter()
        words = bitmask.numpy()
        tokens = [pick(words[i], rng, VOCAB) for i in range(n)]
        t2 = time.perf_counter()
        xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens)
        t3 = time.perf_counter()
        fill.append(t1 - t0)
        adv.append(t3 - t2)
        for i, m in enumerate(matchers):
            if m.is_terminated():
                matchers[i] = xgr.GrammarMatcher(compiled[i % len(compiled)])
    return statistics.median(fill) * 1e6, statistics.median(adv) * 1e6


def masks(args, tokenizer_json: Path) -> None:
    compiler = _core.GrammarCompiler(str(tokenizer_json), [EOS], VOCAB)
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json))
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=VOCAB, stop_token_ids=[EOS])
    except ImportError:
        xgr = None
        print("xgrammar not installed (pip install asyncllm[bench]): no baseline")
    print("mask fill per step, µs (median over steps; advance in parentheses)")
    print(
        f"{'streams':>8} {'schemas':>8} {'asyncllm serial':>20} {'asyncllm 2 threads':>20}"
        f" {'xgrammar':>20}"
    )
    for n in (64,) if args.quick else (64, 256):
        for label, schemas in (("one", [ONE_SCHEMA]), ("mixed", SCHEMAS)):
            line = f"{n:>8} {label:>8}"
            for threads in (1, 2):
                ours = [
                    run_llguidance(compiler, schemas, n, args.steps, r, threads)
                    for r in range(args.repeats)
                ]
                f, a = (statistics.median(x) for x in zip(*ours, strict=True))
                line += f" {f:>11.0f} ({a:>6.0f})"
            if xgr is not None:
                theirs = [
                    run_xgrammar(xgr, info, schemas, n, args.steps, r) for r in range(args.repeats)
                ]
                xf, xa = (statistics.median(x) for x in zip(*theirs, strict=True))
                line += f" {xf:>11.0f} ({xa:>6.0f})"
            print(line, flush=True)


def compile_times(tokenizer_json: Path) -> None:
    compiler = _core.GrammarCompiler(str(tokenizer_json), [EOS], VOCAB)
    times = []
    for s in SCHEMAS:
        t0 = time.perf_counter()
        compiler.compile("json", json.dumps(s))
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))]
    print(
        f"compile of the 30 test schemas: p50 {statistics.median(times):.2f} ms, p99 {p99:.2f} ms"
    )


def engine(args, model: Path) -> None:
    from asyncllm import LLM, SamplingParams, StructuredOutputsParams
    from asyncllm.engine import core
    from asyncllm.structured_output import rows as structured

    spent: list[float] = []  # each mask job's run on the grammar thread
    steps: list[float] = []  # when each engine step began
    result, step = structured.StepMasks.result, core.EngineCore.step

    def timed_result(self):
        out = result(self)
        spent.extend(job.run_seconds for job in self._jobs)
        return out

    def timed_step(self):
        steps.append(time.perf_counter())
        return step(self)

    structured.StepMasks.result = timed_result  # type: ignore[method-assign]
    core.EngineCore.step = timed_step  # type: ignore[method-assign]
    n, max_tokens = 64, 16 if args.quick else 64
    # runs to max_tokens: an array of many small integers
    long_schema = {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 99},
        "minItems": 200,
    }
    so = StructuredOutputsParams(json=long_schema)
    prompts = [f"Numbers {i}:" for i in range(n)]
    rates: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    intervals: dict[str, list[float]] = {"unconstrained": [], "json schema": []}
    # One pair first, not counted: it compiles the schema and warms the caches that
    # every later request finds warm (compile time has its own row above).
    rounds = [("warm-up", None), ("warm-up", so)] + [
        ("unconstrained", None),
        ("json schema", so),
    ] * args.pairs
    with LLM(str(model), multiprocess=False, max_num_seqs=n) as llm:
        for label, s in rounds:
            params = [
                SamplingParams(max_tokens=max_tokens, seed=i, ignore_eos=True, structured_outputs=s)
                for i in range(n)
            ]
            spent.clear()
            steps.clear()
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t0
            toks = sum(len(o.outputs[0].token_ids) for o in outs)
            mask = (
                f", grammar thread (advance + fill) {statistics.median(spent) * 1e6:.0f} µs/step"
                if spent
                else ""
            )
            if label == "warm-up":
                continue
            rates[label].append(toks / dt)
            # decode steps only: the first two admit the prompts
            intervals[label] += [b - a for a, b in zip(steps[2:-1], steps[3:], strict=True)]
            print(f"engine {label:>14}: {toks / dt:8.0f} tok/s ({toks} tokens, {dt:.2f} s){mask}")
    ratios = [c / u for u, c in zip(rates["unconstrained"], rates["json schema"], strict=True)]
    print(
        "engine json schema / unconstrained, per pair: "
        + ", ".join(f"{r:.2f}" for r in ratios)
        + f" (median {statistics.median(ratios):.2f})"
    )
    u, c = (statistics.median(intervals[k]) * 1e3 for k in ("unconstrained", "json schema"))
    print(
        f"engine decode step, median over every pair: unconstrained {u:.2f} ms, json schema"
        f" {c:.2f} ms (ratio {u / c:.2f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each mask row")
    ap.add_argument("--pairs", type=int, default=10, help="engine runs of each kind, alternated")
    ap.add_argument("--quick", action="store_true", help=QUICK_HELP)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.repeats, args.pairs = 8, 1, 1
    tokenizer_json = ASSETS / "tokenizers" / "llama-2" / "tokenizer.json"
    if not tokenizer_json.is_file():
        reason = f"tokenizer assets not found at {tokenizer_json} (set ASYNCLLM_ASSETS)"
        if args.quick:  # the smoke run skips, as the tests do; a real run needs them
            print(f"skipped: {reason}")
            return
        raise SystemExit(reason)
    compile_times(tokenizer_json)
    masks(args, tokenizer_json)
    with tempfile.TemporaryDirectory() as root:
        engine(args, build_model("micro", root))


if __name__ == "__main__":
    main()
