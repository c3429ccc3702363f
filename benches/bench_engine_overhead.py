"""The multiprocess engine's overhead around the model (issue 4's benchmarks).

Subcommands, one per measurement (`all` runs them in turn):

  gap      null executor, zero delay, N streaming (DELTA) requests through
           `AsyncLLM` in multiprocess mode: the core's per-step schedule /
           execute / update / hand-off medians (its own timers), their sum (the
           gap), the busy loop's start-to-start period, and the steps/s the whole
           pipeline sustains, consumers included.
  gil      the same gap with IO idle (an in-process `EngineCore`, outputs
           discarded) against the gap under full multiprocess load, interleaved;
           `--pin` places the core's busy loop alone on one CPU (a diagnostic).
  busy     null executor with a 5 ms delay, N streams consumed by `AsyncLLM`:
           the fraction of the core's wall time (first step start -> last step
           end) spent inside the delay, and the consumers' inter-token latency
           p50/p99 against the step time.
  overlap  serial against overlap scheduling (`async_scheduling`), same run: the
           busy fraction with a 5 ms null step and the tokens/s with a 1 ms one,
           N streams, medians of --runs runs per mode (`--overlap-rows busy`
           runs only the first; `--output-kind final_only` consumes like offline
           `LLM.generate`, so the consumers' wake-ups do not set the rate).
  stop     64 streams on a real model (default: the shipped asyncllm-tiny, code
           prompts) with three never-matching stop strings vs none: throughput
           ratio, interleaved repeats in one engine.
  startup  wall time from `LLM(...)` / `AsyncLLM.from_engine_args(...)` to the
           first generated token on the micro model, a fresh process each time.

    python benches/bench_engine_overhead.py [all] --runs 5 [--json out.json] [--quick]

Only steps where at least 90 % of the streams decode count toward the gap
medians, so the arrival ramp and the tail do not blur the steady state.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from asyncllm import AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams

PROMPT_LEN = 16
NEVER_STOPS = ["<<never-stop-A>>", "\u2603\u2603\u2603zz", "qqq xxx qqq"]


def _build_micro(root: Path) -> Path:
    """The micro model, built in a child process: importing torch here would put
    its objects on this (front-end) process's heap, and a full GC over them stalls
    the output handler for ~200 ms, which a torch-free front end never sees."""
    out = root / "micro"
    if not (out / "config.json").is_file():
        code = f"from models import build_model; build_model('micro', {str(root)!r})"
        if subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent).returncode:
            raise SystemExit("could not build the micro model (its error is above)")
    return out


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _prompts(n: int) -> list[list[int]]:
    # distinct prompts (no prefix-cache sharing), ids clear of special tokens
    return [[100 + (i * 31 + j * 7) % 20000 for j in range(PROMPT_LEN)] for i in range(n)]


def _step_summary(t: dict[str, list[Any]], n: int) -> dict[str, float]:
    """Medians (µs) over the steady-state steps: at least 90 % of the `n` streams
    produced a token (requests reach the core over a few steps, so a full batch
    of exactly `n` decodes is rarer than one of n - 1)."""
    rows = [i for i, k in enumerate(t["num_outputs"]) if k > 0]
    handoff = t["handoff"]
    # handoff has one entry per step with outputs, in order (its ring may be shorter)
    ho = dict(zip(rows[len(rows) - len(handoff) :], handoff, strict=True))
    full = [i for i in rows if t["num_outputs"][i] >= 0.9 * n and i in ho]
    us = 1e6
    sched = [t["schedule"][i] * us for i in full]
    exe = [t["execute"][i] * us for i in full]
    upd = [t["update"][i] * us for i in full]
    hand = [ho[i] * us for i in full]
    gap = [s + u + h for s, u, h in zip(sched, upd, hand, strict=True)]
    starts = t["start"]
    period = [(starts[i + 1] - starts[i]) * us for i in full if i + 1 < len(starts)]
    out = {
        "steps": len(full),
        "schedule_us": _med(sched),
        "execute_us": _med(exe),
        "update_us": _med(upd),
        "handoff_us": _med(hand),
        "gap_us": _med(gap),
        "period_us": _med(period),
        "period_minus_execute_us": _med(
            [p - e for p, e in zip(period, exe[: len(period)], strict=True)]
        ),
    }
    if "backpressure" in t:
        bp = t["backpressure"]
        out["backpressure_waits"] = len(bp)
        out["backpressure_ms_total"] = sum(bp) * 1e3
    return out


# -- AsyncLLM runs ------------------------------------------------------------------


async def _stream_run(
    engine: AsyncLLM,
    n: int,
    max_tokens: int,
    stop: list[str] | None = None,
    tag: str = "",
    prompts: list[Any] | None = None,
    kind: RequestOutputKind = RequestOutputKind.DELTA,
) -> dict[str, Any]:
    """n concurrent streams (DELTA unless `kind` says otherwise); returns wall time,
    token count and per-arrival inter-token gaps (seconds)."""
    params = SamplingParams(
        max_tokens=max_tokens,
        ignore_eos=True,
        output_kind=kind,
        stop=stop,
        temperature=0.0,
    )
    gaps: list[float] = []
    per_token: list[float] = []
    counts = [0] * n

    async def one(i: int, prompt: list[int]) -> None:
        last = None
        request = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        async for out in engine.generate(request, params, request_id=f"{tag}{i}"):
            now = time.perf_counter()
            k = len(out.outputs[0].token_ids)
            if kind != RequestOutputKind.DELTA:  # cumulative: count the new ones
                k, counts[i] = k - counts[i], k
            else:
                counts[i] += k
            if last is not None and k:
                gaps.append(now - last)
                per_token.append((now - last) / k)
            last = now

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts or _prompts(n))))
    wall = time.perf_counter() - t0
    return {"wall": wall, "tokens": sum(counts), "gaps": gaps, "per_token": per_token}


def _null_args(
    model: Path, delay_ms: float = 0.0, n: int = 256, overlap: bool = False
) -> EngineArgs:
    return EngineArgs(
        model=str(model),
        executor="null",
        null_step_delay_ms=delay_ms,
        async_scheduling=overlap,
        max_num_seqs=n,
        max_num_batched_tokens=max(4096, n * PROMPT_LEN),
        max_model_len=2048,
        collect_step_timings=True,  # the core's step timers: what this bench reads
    )


def _pin_apart(engine: AsyncLLM) -> None:
    """Diagnostic placement (`gil --pin`, Linux, 2+ CPUs): the core's busy-loop
    thread alone on CPU 0; its IO threads and this front-end process on CPU 1."""
    pid = engine.client.process.pid
    os.sched_setaffinity(0, {1})
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {0} if int(tid) == pid else {1})


async def _mp_null_run(
    model: Path,
    n: int,
    tokens: int,
    delay_ms: float,
    runs: int,
    pin: bool = False,
    overlap: bool = False,
    kind: RequestOutputKind = RequestOutputKind.DELTA,
) -> list[dict[str, Any]]:
    args = _null_args(model, delay_ms, n, overlap)
    engine = AsyncLLM.from_engine_args(args, multiprocess=True)
    if pin:
        _pin_apart(engine)
    results = []
    try:
        await _stream_run(engine, n, 32, tag="warm")  # warm-up
        for r in range(runs):
            await engine.call_utility("get_step_timings", {"clear": True})
            res = await _stream_run(engine, n, tokens, tag=f"r{r}-", kind=kind)
            t = await engine.call_utility("get_step_timings")
            summary = _step_summary(t, n)
            nsteps = sum(1 for k in t["num_outputs"] if k > 0)
            summary["pipeline_steps_per_s"] = nsteps / res["wall"]
            summary["tokens_per_s"] = res["tokens"] / res["wall"]
            # the core's wall time: first step start -> last step end (with overlap,
            # steps overlap: "execute" is the forward on the runner thread, and the
            # core reports each step's end)
            last = len(t["start"]) - 1
            end = (
                t["end"][-1]
                if t.get("end")
                else t["start"][last] + t["schedule"][last] + t["execute"][last] + t["update"][last]
            )
            core_wall = end - t["start"][0]
            summary["busy_fraction"] = sum(t["execute"]) / core_wall
            # stricter: only the requested sleep itself counts as busy
            summary["delay_fraction"] = len(t["start"]) * delay_ms / 1e3 / core_wall
            summary["itl_p50_ms"] = _pct(res["gaps"], 0.5) * 1e3
            summary["itl_p99_ms"] = _pct(res["gaps"], 0.99) * 1e3
            summary["itl_per_token_p50_ms"] = _pct(res["per_token"], 0.5) * 1e3
            summary["itl_per_token_p99_ms"] = _pct(res["per_token"], 0.99) * 1e3
            summary["tokens_per_arrival"] = res["tokens"] / max(1, len(res["gaps"]) + n)
            summary["step_period_p50_ms"] = summary["period_us"] / 1e3
            results.append(summary)
    finally:
        engine.shutdown()
    return results


def _inproc_gap(model: Path, n: int, tokens: int) -> dict[str, float]:
    """An EngineCore stepped in this process, outputs discarded: IO idle."""
    from asyncllm.engine.core import build_engine_core
    from asyncllm.messages import EngineCoreRequest

    core = build_engine_core(_null_args(model, 0.0, n))
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for i, p in enumerate(_prompts(n)):
        core.add_request(EngineCoreRequest(i, p, params))
    while core.has_unfinished_requests():
        core.step()
    t = list(core.step_timings)
    timings = {
        "start": [x[0] for x in t],
        "schedule": [x[1] for x in t],
        "execute": [x[2] for x in t],
        "update": [x[3] for x in t],
        "num_outputs": [x[4] for x in t],
        "handoff": [0.0 for x in t if x[4] > 0],  # discarded: no hand-off
    }
    return _step_summary(timings, n)


# -- subcommands --------------------------------------------------------------------


def cmd_gap(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    runs = asyncio.run(_mp_null_run(model, a.streams, a.tokens, 0.0, a.runs))
    return {"runs": runs, "median": _median_dicts(runs)}


def cmd_gil(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    idle, loaded = [], []
    for _ in range(a.runs):  # interleaved: idle, loaded, idle, loaded, ...
        if a.pin:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
        idle.append(_inproc_gap(model, a.streams, a.tokens))
        loaded.extend(asyncio.run(_mp_null_run(model, a.streams, a.tokens, 0.0, 1, a.pin)))
    ratios = [ld["gap_us"] / i["gap_us"] for i, ld in zip(idle, loaded, strict=True)]
    return {
        "idle": _median_dicts(idle),
        "loaded": _median_dicts(loaded),
        "loaded_over_idle_gap": ratios,
        "median_ratio": _med(ratios),
    }


def cmd_busy(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    runs = asyncio.run(_mp_null_run(model, a.streams, a.busy_tokens, 5.0, a.runs))
    return {"runs": runs, "median": _median_dicts(runs)}


def cmd_overlap(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    """Serial and overlap scheduling in one run, one engine per mode and row."""
    rows = {"busy": (5.0, "busy_fraction"), "tokens": (1.0, "tokens_per_s")}
    out: dict[str, Any] = {}
    for row in a.overlap_rows.split(","):
        delay, key = rows[row]
        medians = {}
        for mode in ("serial", "overlap"):
            runs = asyncio.run(
                _mp_null_run(
                    model,
                    a.streams,
                    a.busy_tokens,
                    delay,
                    a.runs,
                    overlap=mode == "overlap",
                    kind=RequestOutputKind[a.output_kind.upper()],
                )
            )
            medians[mode] = _median_dicts(runs)
            out[f"{row}_{mode}_{key}_runs"] = [r[key] for r in runs]
        for mode in ("serial", "overlap"):
            m = medians[mode]
            out[f"{row}_{mode}"] = {
                k: m[k]
                for k in (key, "delay_fraction", "gap_us", "period_us", "execute_us", "steps")
            }
        if key == "tokens_per_s":
            out["tokens_per_s_overlap_over_serial"] = (
                medians["overlap"][key] / medians["serial"][key]
            )
    return out


def cmd_stop(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    # The shipped model writes real code, so the detokenizer and the stop-string
    # matcher see real text; the micro model (random weights) is the old baseline.
    real = a.stop_model != "micro"
    name = a.stop_model if real else str(model)
    prompts: list[Any] | None = None
    if real:
        prompts = [f"def function_{i}(value, count={i}):\n    " for i in range(64)]

    async def go() -> dict[str, Any]:
        engine = AsyncLLM.from_engine_args(
            EngineArgs(model=name, max_num_seqs=64, max_model_len=512, seed=0),
            multiprocess=True,
        )
        plain, stops = [], []
        try:
            await _stream_run(engine, 64, 16, tag="warm", prompts=prompts)
            for r in range(a.runs):
                order = [(None, plain), (NEVER_STOPS, stops)]
                if r % 2:
                    order.reverse()
                for stop, sink in order:
                    tag = f"s{r}{bool(stop)}-"
                    res = await _stream_run(
                        engine, 64, a.stop_tokens, stop, tag=tag, prompts=prompts
                    )
                    sink.append(res["tokens"] / res["wall"])
        finally:
            engine.shutdown()
        ratios = [s / p for s, p in zip(stops, plain, strict=True)]
        return {
            "plain_tok_s": plain,
            "stop_tok_s": stops,
            "ratio_stop_over_plain": ratios,
            "median_ratio": _med(ratios),
            "median_plain_tok_s": _med(plain),
            "median_stop_tok_s": _med(stops),
        }

    return asyncio.run(go())


_STARTUP = r"""
import asyncio, sys, time
t_import = time.perf_counter()
from asyncllm import LLM, AsyncLLM, EngineArgs, SamplingParams
t0 = time.perf_counter()
model, mode = sys.argv[1], sys.argv[2]
params = SamplingParams(max_tokens=1, temperature=0.0)
if mode == "llm":
    llm = LLM(model=model)
    llm.generate(["Hello"], params, use_tqdm=False)
    t1 = time.perf_counter()
    llm.shutdown()
else:
    async def go():
        engine = AsyncLLM.from_engine_args(EngineArgs(model=model))
        async for _ in engine.generate("Hello", params, request_id="a"):
            t = time.perf_counter()
            break
        engine.shutdown()
        return t
    t1 = asyncio.run(go())
print(f"{t1 - t0:.4f} {t0 - t_import:.4f}")
"""


def cmd_startup(a: argparse.Namespace, model: Path) -> dict[str, Any]:
    out: dict[str, list[float]] = {"llm": [], "async": [], "llm_import": [], "async_import": []}
    for _ in range(a.runs):
        for mode in ("llm", "async"):
            p = subprocess.run(
                [sys.executable, "-c", _STARTUP, str(model), mode],
                capture_output=True,
                text=True,
                check=True,
            )
            first, imp = map(float, p.stdout.split()[-2:])
            out[mode].append(first)
            out[f"{mode}_import"].append(imp)
    return {**out, "median_llm_s": _med(out["llm"]), "median_async_s": _med(out["async"])}


def _median_dicts(ds: list[dict[str, Any]]) -> dict[str, float]:
    keys = [k for k in ds[0] if isinstance(ds[0][k], int | float)]
    return {k: _med([d[k] for d in ds]) for k in keys}


COMMANDS = {
    "gap": cmd_gap,
    "gil": cmd_gil,
    "busy": cmd_busy,
    "overlap": cmd_overlap,
    "stop": cmd_stop,
    "startup": cmd_startup,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("command", nargs="?", default="all", choices=[*COMMANDS, "all"])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream (gap, gil)")
    ap.add_argument("--busy-tokens", type=int, default=128, help="tokens per stream (busy)")
    ap.add_argument("--stop-tokens", type=int, default=64, help="tokens per stream (stop)")
    ap.add_argument(
        "--stop-model",
        default="asyncllm-tiny",
        help="model of `stop`: a path, asyncllm-tiny, micro",
    )
    ap.add_argument("--models", default=None, help="where benchmark models are built")
    ap.add_argument(
        "--pin",
        action="store_true",
        help="gil: the core's busy loop alone on CPU 0, its IO threads and the front end on CPU 1",
    )
    ap.add_argument(
        "--overlap-rows",
        default="busy,tokens",
        help="overlap: busy (5 ms step: busy fraction), tokens (1 ms step: tokens/s), or both",
    )
    ap.add_argument(
        "--output-kind",
        default="delta",
        choices=["delta", "final_only"],
        help="overlap: streams that wake their consumer every step (delta), or only at"
        " the end (final_only, as offline `LLM.generate` does)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--quick", action="store_true", help="1 run of 16 streams x 16 tokens: checks that it runs"
    )
    a = ap.parse_args()
    if a.quick:
        a.runs, a.streams, a.tokens, a.busy_tokens, a.stop_tokens = 1, 16, 16, 8, 8
    root = Path(a.models or os.path.join(tempfile.gettempdir(), "asyncllm-bench-models"))
    model = _build_micro(root)
    results = {}
    for name in COMMANDS if a.command == "all" else [a.command]:
        res = COMMANDS[name](a, model)
        results[name] = res
        shown = {k: v for k, v in res.items() if k != "runs"}
        print(f"== {name}\n{json.dumps(shown, indent=1, default=float)}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
