"""One assistant turn, run for the endpoints that speak in turns rather than
choices (`/v1/responses`, `/v1/messages`): a prepared chat request (always one
choice) generated and read by its output parser, as a stream of `OutputDelta`s
that ends with a `TurnEnd`. Each endpoint renders those in its own shape."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from asyncllm.server.output_parser import OutputDelta, OutputParser
from asyncllm.server.serving_chat import ChatServing, Prepared


@dataclass
class TurnEnd:
    """How the turn ended: the engine's finish and stop reasons, whether the
    answer held tool calls, and the token counts for usage."""

    finish_reason: str
    stop_reason: int | str | None
    has_calls: bool
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int | None
    num_reasoning_tokens: int


async def run_turn(
    chat: ChatServing, prep: Prepared, request_id: str
) -> AsyncIterator[OutputDelta | TurnEnd]:
    """The turn's deltas as they come, then its end. Closing it aborts the
    request; engine errors arrive as APIErrors (ServingBase.generate)."""
    parser = chat.parser(prep.plan) or OutputParser(None, None)
    timer = chat.metrics.start(len(prep.ids))
    num_tokens = num_reasoning = 0
    num_cached = None
    has_calls = False
    async for out in chat.generate(prep.ids, prep.text, prep.params, request_id, timer, prep.lora):
        if out.num_cached_tokens is not None:
            num_cached = out.num_cached_tokens
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            final = c.finish_reason is not None
            delta = parser.finish(c.text) if final else parser.feed(c.text)
            if delta.reasoning and not delta.content and not delta.tool_calls:
                num_reasoning += len(c.token_ids)
            has_calls = has_calls or bool(delta.tool_calls)
            if delta:
                yield delta
            if c.finish_reason is not None:
                yield TurnEnd(
                    c.finish_reason,
                    c.stop_reason,
                    has_calls,
                    len(prep.ids),
                    num_tokens,
                    num_cached,
                    num_reasoning,
                )
                return
