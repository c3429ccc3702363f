"""One benchmark in two checkouts, alternated in one run: old and new take turns
(old first in even rounds, new first in odd ones), so load from elsewhere on the
machine hits both alike; each figure is reported as the two trees' medians and
the median of the per-round ratios new / old.

    python benches/ab_trees.py codec   --old ../old-tree --new . [--rounds 5]
    python benches/ab_trees.py gap     --old ../old-tree --new . [--rounds 5]
    python benches/ab_trees.py offline --old ../old-tree --new . [--rounds 3]

Each tree runs its own `benches/bench_*.py` with its own `.venv/bin/python`
(`--old-python`/`--new-python` to change). Figures: codec = the asyncllm rows of
`bench_codec.py` (µs per operation, and the GIL-held parts); gap =
`bench_engine_overhead.py gap --runs 1` (the per-step gap and the loop period,
µs); offline = `bench_offline.py --models micro --workloads fixed --streams 256
--skip-transformers --skip-floor --repeats 1` (engine tokens/s, greedy and sampled).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

Figures = dict[str, float]

_ROW = re.compile(r"^\| (encode|decode|decode\+access) \| asyncllm \| ([0-9.]+) \|")
_GIL_ROW = re.compile(r"^\| (encode: extract|encode: copy into bytes|decode: wrap) \| ([0-9.]+) \|")


def _run(python: Path, tree: Path, args: list[str]) -> str:
    done = subprocess.run(
        [str(python), *args], cwd=tree, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def codec(python: Path, tree: Path) -> Figures:
    out = _run(python, tree, ["benches/bench_codec.py", "--reps", "5", "--window", "0.1"])
    figures: Figures = {}
    case = ""
    for line in out.splitlines():
        if line.startswith("### "):
            case = line[4:].strip()
        elif m := _ROW.match(line) or _GIL_ROW.match(line):
            figures[f"{case}: {m.group(1)} µs"] = float(m.group(2))
    return figures


def gap(python: Path, tree: Path) -> Figures:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gap.json"
        _run(
            python,
            tree,
            ["benches/bench_engine_overhead.py", "gap", "--runs", "1", "--json", str(path)],
        )
        m = json.loads(path.read_text())["gap"]["median"]
    return {"gap µs": m["gap_us"], "loop period µs": m["period_us"]}


def offline(python: Path, tree: Path) -> Figures:
    args = [
        "benches/bench_offline.py", "--models", "micro", "--workloads", "fixed",
        "--streams", "256", "--skip-transformers", "--skip-floor", "--repeats", "1",
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "offline.json"
        _run(python, tree, [*args, "--json", str(path)])
        rows = json.loads(path.read_text())
    figures = {f"micro 256 {r['sampling']} tok/s": r["engine_tok_s"] for r in rows}
    figures |= {f"micro 256 {r['sampling']} step ms": r["decode_step_ms"] for r in rows}
    return figures


BENCHES: dict[str, Callable[[Path, Path], Figures]] = {
    "codec": codec,
    "gap": gap,
    "offline": offline,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("bench", choices=list(BENCHES))
    ap.add_argument("--old", type=Path, required=True)
    ap.add_argument("--new", type=Path, required=True)
    ap.add_argument("--old-python", type=Path)
    ap.add_argument("--new-python", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    trees = {
        "old": (a.old_python or a.old / ".venv/bin/python", a.old.resolve()),
        "new": (a.new_python or a.new / ".venv/bin/python", a.new.resolve()),
    }
    bench = BENCHES[a.bench]
    runs: dict[str, list[Figures]] = {"old": [], "new": []}
    for r in range(a.rounds):
        for side in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[side].append(bench(*trees[side]))
            print(f"round {r + 1}/{a.rounds} {side} done", file=sys.stderr, flush=True)
    print(f"{a.bench}: {a.rounds} rounds, old {a.old} / new {a.new}\n")
    print("| figure | old (median) | new (median) | new / old (median of rounds) |")
    print("|---|---:|---:|---:|")
    for key in runs["old"][0]:
        old = [f[key] for f in runs["old"]]
        new = [f[key] for f in runs["new"]]
        ratios = [n / o for n, o in zip(new, old, strict=True) if o]
        print(
            f"| {key} | {statistics.median(old):.1f} | {statistics.median(new):.1f} | "
            f"{statistics.median(ratios):.3f} |"
        )
    print("\nEach round, old / new:\n")
    for key in runs["old"][0]:
        pairs = ", ".join(
            f"{o[key]:.1f} / {n[key]:.1f}" for o, n in zip(runs["old"], runs["new"], strict=True)
        )
        print(f"- {key}: {pairs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
