"""`asyncllm generate`: one prompt streamed to the terminal, or a file of prompts
(one per line, '-' for stdin) run as a batch with a progress bar."""

from __future__ import annotations

import argparse
import asyncio
import sys

from asyncllm.config import EngineArgs
from asyncllm.sampling_params import RequestOutputKind, SamplingParams


def run_generate(ns: argparse.Namespace) -> int:
    from asyncllm.server.cli import engine_args_from, sampling_params_from

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
