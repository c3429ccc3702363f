"""Helpers the multiprocess tests share: how many tokens a stream produced, and
whether a process is still alive (a zombie is not)."""

from __future__ import annotations

from asyncllm import AsyncLLM, SamplingParams


async def stream_length(
    engine: AsyncLLM, prompt: list[int], rid: str, params: SamplingParams
) -> int:
    """Consume one request's stream; the number of tokens it ended with."""
    n = 0
    async for out in engine.generate({"prompt_token_ids": prompt}, params, rid):
        n = len(out.outputs[0].token_ids)
    return n


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, or reaped while reading
        return False
