"""Detokenization throughput: asyncllm's batched `Detokenizer.step` against the Python
`tokenizers` `DecodeStream`, on the same streams, single thread.

256 concurrent streams x 512 tokens of real text (several scripts, code, emoji).
Ours: one `step` call per engine step for all streams (the last one finishing them),
given the step's token ids as a list of ints, or as an `array('I')` (how the front end
can pass ids decoded from the wire's raw token bytes without making Python ints).
Theirs: one `DecodeStream.step` per stream per token. The texts must be identical.
Reports tokens/s of each and the ratios measured in the same run; medians over runs.

    python benches/bench_detok.py [--tokenizer llama-3-8b] [--runs 5] [--quick]
"""

from __future__ import annotations

import argparse
import array
import os
import statistics
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from asyncllm._core import Detokenizer

ASSETS = Path(
    os.environ.get("ASYNCLLM_ASSETS", Path(__file__).resolve().parents[2] / "shared" / "assets")
)

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Streaming detokenization turns token "
    "ids back into text one step at a time, and it must never emit text it would later "
    "have to take back. ",
    "日本語の文章です。中文也可以：你好，世界！今天天气很好。한국어 텍스트도 있습니다. ",
    "Emoji: 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👩🏽‍💻 coder, 🇯🇵🇺🇸 and ❤️‍🔥. ",
    "مرحبا بالعالم! هذه جملة عربية مع أرقام وعلامات ترقيم؟ ",
    "def main():\n\tfor i in range(10):\n\t\tprint(i,    end='  ')\n    return {'a': [1, 2]}\n",
    "Ελληνικά, русский текст, עברית, हिन्दी — mixed “quotes” … and ‘more’. ",
]


def make_streams(tok: Tokenizer, num_streams: int, num_tokens: int) -> list[list[int]]:
    """`num_streams` different token sequences of `num_tokens` ids each, cut where
    the text is whole (no character split at either end), since DecodeStream has no
    way to flush a character the stream leaves unfinished."""
    streams = []
    for s in range(num_streams):
        parts, ids = [], []
        k = s
        while len(ids) < num_tokens + 16:
            parts.append(CORPUS[k % len(CORPUS)])
            k += 1 + s % 3
            ids = tok.encode("".join(parts), add_special_tokens=False).ids
        for start in range(16):
            window = ids[start : start + num_tokens]
            text = tok.decode(window)
            if "\ufffd" not in text[:1] + text[-1:]:
                break
        streams.append(window)
    return streams


def run_ours(det: Detokenizer, steps: list) -> tuple[float, list[str]]:
    """One `step` per engine step; the texts are joined after the clock stops."""
    ids = list(range(len(steps[0])))
    for i in ids:
        det.add_request(i, [])
    last = len(steps) - 1
    per_step = []
    start = time.perf_counter()
    for n, step in enumerate(steps):
        # The last step finishes every stream (as EOS/length would).
        per_step.append(det.step(ids, step, ids if n == last else None).texts)
    elapsed = time.perf_counter() - start
    return elapsed, ["".join(column) for column in zip(*per_step, strict=True)]


def run_decode_stream(tok: Tokenizer, streams: list[list[int]]) -> tuple[float, list[str]]:
    decoders = [DecodeStream(skip_special_tokens=True) for _ in streams]
    texts = [[] for _ in streams]
    num_tokens = len(streams[0])
    start = time.perf_counter()
    for t in range(num_tokens):
        for ds, stream, parts in zip(decoders, streams, texts, strict=True):
            chunk = ds.step(tok, stream[t])
            if chunk is not None:
                parts.append(chunk)
    elapsed = time.perf_counter() - start
    return elapsed, ["".join(p) for p in texts]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer", action="append", help="asset name (repeatable)")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one tokenizer, 16 x 64 tokens, 1 run")
    args = parser.parse_args()
    names = args.tokenizer or ["llama-3-8b", "llama-2"]
    if args.quick:
        names, args.streams, args.tokens, args.runs = names[:1], 16, 64, 1
    print(f"{args.streams} streams x {args.tokens} tokens, single thread, {args.runs} runs")
    print(
        f"{'tokenizer':<14} {'ours (list) tok/s':>18} {'ours (array) tok/s':>19}"
        f" {'DecodeStream tok/s':>19} {'ratio list':>11} {'ratio array':>12}"
    )
    for name in names:
        path = ASSETS / "tokenizers" / name / "tokenizer.json"
        if not path.is_file():
            print(f"{name}: assets not found at {path}", file=sys.stderr)
            return 1
        tok = Tokenizer.from_file(str(path))
        det = Detokenizer(str(path))
        streams = make_streams(tok, args.streams, args.tokens)
        # Each engine step gives every stream one token (a bare int; a list per
        # request works too, for steps with several tokens).
        steps = [[s[t] for s in streams] for t in range(args.tokens)]
        arrays = [array.array("I", step) for step in steps]
        total = args.streams * args.tokens
        rates: dict[str, list[float]] = {"list": [], "array": [], "ds": []}
        ratios: dict[str, list[float]] = {"list": [], "array": []}
        for _ in range(args.runs):
            t_list, text_list = run_ours(det, steps)
            t_array, text_array = run_ours(det, arrays)
            t_ds, text_ds = run_decode_stream(tok, streams)
            for label, texts in [("list", text_list), ("array", text_array)]:
                if texts != text_ds:
                    pairs = zip(texts, text_ds, strict=True)
                    bad = next(i for i, (a, b) in enumerate(pairs) if a != b)
                    print(f"{name} ({label}): stream {bad} differs", file=sys.stderr)
                    return 1
            for label, t in [("list", t_list), ("array", t_array), ("ds", t_ds)]:
                rates[label].append(total / t)
            ratios["list"].append(t_ds / t_list)
            ratios["array"].append(t_ds / t_array)
        med = {k: statistics.median(v) for k, v in rates.items()}
        print(
            f"{name:<14} {med['list']:>18,.0f} {med['array']:>19,.0f} {med['ds']:>19,.0f}"
            f" {statistics.median(ratios['list']):>10.1f}x"
            f" {statistics.median(ratios['array']):>11.1f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
