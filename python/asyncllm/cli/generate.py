"""`asyncllm generate`: one prompt streamed to the terminal, or a file of prompts
(one per line, '-' for stdin) run as a batch with a progress bar."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

from asyncllm.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_args_from,
    sampling_params_from,
)
from asyncllm.config import EngineArgs
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


def add_parser(sub: Any) -> None:
    """`generate`: MODEL, the engine flags, a prompt or a file of them, sampling."""
    p = sub.add_parser("generate", help="generate from prompts on the command line")
    add_engine_args(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one prompt, streamed to the terminal")
    src.add_argument(
        "--prompts-file", help="a file with one prompt per line ('-': stdin), run as a batch"
    )
    add_sampling_args(p)


def run(ns: argparse.Namespace) -> int:
    """Generate for `--prompt` (streamed) or `--prompts-file` (a batch); the exit status."""
    args = engine_args_from(ns)
    if ns.prompt is not None:
        return asyncio.run(_stream_one(args, ns.prompt, sampling_params_from(ns)))
    from asyncllm.frontend.llm import LLM

    if ns.prompts_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(ns.prompts_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    prompts = [line for line in lines if line.strip()]
    if not prompts:
        print("asyncllm: error: no prompts", file=sys.stderr)
        return 2
    kwargs = {f: getattr(args, f) for f in args.__dataclass_fields__ if f != "model"}
    with LLM(args.model, **kwargs) as llm:
        outputs = llm.generate(prompts, sampling_params_from(ns), use_tqdm=True)
    for out in outputs:
        sys.stdout.write(out.outputs[0].text.replace("\n", "\\n") + "\n")
    return 0


async def _stream_one(args: EngineArgs, prompt: str, params: SamplingParams) -> int:
    from asyncllm.frontend.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(args)
    try:
        params.output_kind = RequestOutputKind.DELTA
        async for out in engine.generate(prompt, params, "generate-0"):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0
