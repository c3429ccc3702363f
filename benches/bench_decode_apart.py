"""The decode step against the floor measured in separate processes, alternating.

`bench_offline.py` times the engine step and the floor step in one loop, which cancels
load from elsewhere but lets one side's after-effects (a thread team left spinning,
caches) touch the other. Here each process times only one of them — the floor never
shares a process with asyncllm's kernel — and processes alternate, so the two checks
bracket the truth between them.

    python benches/bench_decode_apart.py [--models micro small] [--pairs 4] [--quick]

Batch 256 decodes at context ~96 (the engine's steps span 85-106, the floor's cache
is sized for 106), 21 timed steps per process, median per process.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

HERE = Path(__file__).resolve().parent
CONTEXT, REPEATS = 96, 21


def child(mode: str, model_dir: str, context: int = CONTEXT, repeats: int = REPEATS) -> None:
    sys.path.insert(0, str(HERE))
    from bench_offline import decoding_core
    from floor import FloorDecode

    times = []
    if mode == "floor":
        floor = FloorDecode(model_dir, 256, context + repeats // 2)
        floor.step()
        for _ in range(repeats):
            t0 = time.perf_counter()
            floor.step()
            times.append(time.perf_counter() - t0)
    else:
        core = decoding_core(Path(model_dir), context - repeats // 2, repeats)
        for _ in range(repeats):
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
    print(f"{1e3 * median(times):.3f}")


def run(mode: str, model_dir: Path, quick: bool = False) -> float:
    cmd = [sys.executable, __file__, "--child", mode, str(model_dir)]
    out = subprocess.run(
        [*cmd, "--quick"] if quick else cmd,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["micro", "small"])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="micro, one short pair: checks it runs")
    a = ap.parse_args()
    if a.child:
        # quick: 3 steps around context 36 (the prefill is 32 tokens)
        child(*a.child, *((36, 3) if a.quick else ()))
        return
    sys.path.insert(0, str(HERE))
    from models import build_model

    if a.quick:
        a.models, a.pairs = ["micro"], 1

    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            model_dir = build_model(name, Path(tmp))
            floor, engine = [], []
            for i in range(a.pairs):
                order = [("floor", floor), ("engine", engine)]
                for mode, sink in order if i % 2 == 0 else order[::-1]:
                    sink.append(run(mode, model_dir, a.quick))
            pairs = [e / f for e, f in zip(engine, floor, strict=True)]
            print(
                f"{name}: floor ms {[round(x, 1) for x in floor]}, "
                f"engine ms {[round(x, 1) for x in engine]}; "
                f"ratio of medians {median(engine) / median(floor):.3f}, "
                f"median of pair ratios {median(pairs):.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
