"""Tool calling on `/v1/chat/completions`: what a request's `tools` and
`tool_choice` do to its prompt, its sampling and its reply.

- "none": the tools are still rendered into the prompt (vLLM's default; OpenAI
  documents "none" as "the model will not call a tool", not as hiding them), and
  the output is plain content.
- "auto" (the default when tools are given): the output is read by the
  `--tool-call-parser` (hermes); calls found become `tool_calls`, `finish_reason`
  "tool_calls".
- "required" and a named function: the output is constrained as vLLM does it —
  to a JSON array of `{"name", "parameters"}` objects (one `anyOf` branch per
  tool) for "required", to the function's parameters schema for a named one —
  and the server builds `tool_calls` from it. `finish_reason` is "tool_calls"
  for "required" and the engine's ("stop") for a named function, as in vLLM.

A reply cut by max_tokens keeps `finish_reason` "length" whatever it holds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asyncllm.errors import ConfigError
from asyncllm.sampling_params import SamplingParams
from asyncllm.server.output_parser import OutputParser
from asyncllm.server.protocol import ChatCompletionRequest, bad_request
from asyncllm.server.protocol_tools import ChatTool, NamedToolChoice
from asyncllm.server.reasoning import ReasoningParser
from asyncllm.server.sse import ChunkRenderer, finish_json
from asyncllm.server.tool_parsers import ToolParser
from asyncllm.server.tool_parsers.base import MAX_TOOL_CALLS
from asyncllm.server.tool_parsers.forced import NamedToolParser, RequiredToolParser
from asyncllm.structured_output.params import StructuredOutputsParams

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """One request's tool calling, decided before it runs."""

    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict[str, Any]]  # as the chat template gets them
    make_parser: Callable[[], ToolParser] | None  # one per choice; None: content only

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """`tools` as the chat template gets them (the same for /tokenize as for
    /v1/chat/completions); a 400 if two functions share a name."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"tools has two functions named {dup!r}", "tools")
    return [t.model_dump(exclude_none=True) for t in tools]


def plan_tools(req: ChatCompletionRequest, parser: type[ToolParser]) -> ToolPlan | None:
    """The request's tool plan (None without tools); 400s name the field at fault."""
    choice = req.tool_choice
    if not req.tools:
        if choice is not None and choice != "none":
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    tools = template_tools(req.tools)
    parallel = req.parallel_tool_calls
    if choice == "none":
        return ToolPlan("none", tools, None)
    if choice is None or choice == "auto":
        return ToolPlan("auto", tools, lambda: parser(parallel))
    if choice == "required":
        return ToolPlan("required", tools, lambda: RequiredToolParser(parallel))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    if name not in names:
        raise bad_request(
            f"tool_choice names the function {name[:64]!r}, which is not in tools",
            "tool_choice",
        )
    return ToolPlan("named", tools, lambda: NamedToolParser(name, parallel))


def constrain(req: ChatCompletionRequest, plan: ToolPlan, params: SamplingParams) -> SamplingParams:
    """`params`, for "required" and a named function with the JSON schema the
    output must match (a validated copy, so SamplingParams checks it)."""
    if plan.mode not in ("required", "named"):
        return params
    assert req.tools is not None
    if params.structured_outputs is not None:
        raise bad_request(
            "tool_choice 'required' or a named function constrains the output itself: "
            "it cannot be combined with response_format or structured_outputs",
            "tool_choice",
        )
    if plan.mode == "named":
        assert isinstance(req.tool_choice, NamedToolChoice)
        tool = next(t for t in req.tools if t.function.name == req.tool_choice.function.name)
        schema = tool.function.parameters or _EMPTY_PARAMETERS
    else:
        schema = required_schema(req.tools, req.parallel_tool_calls)
    try:
        return params.clone(structured_outputs=StructuredOutputsParams(json=schema))
    except ConfigError as exc:
        raise bad_request(
            str(exc).replace("StructuredOutputsParams.json", "tools"), "tools"
        ) from None


def required_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a non-empty array of calls, each
    `{"name": <one of the tools>, "parameters": <its parameters>}`. The tools'
    `$defs` move to the root, where their `#/$defs/...` references point."""
    defs: dict[str, Any] = {}
    branches = []
    for tool in tools:
        params = dict(tool.function.parameters or _EMPTY_PARAMETERS)
        for key, value in params.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise bad_request(
                    f"tools define $defs/{key} twice, differently: rename one", "tools"
                )
            defs[key] = value
        branches.append(
            {
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "parameters": params,
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "maxItems": MAX_TOOL_CALLS if parallel else 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if defs:
        schema["$defs"] = defs
    return schema


def output_parser(
    plan: ToolPlan | None, reasoning: type[ReasoningParser] | None
) -> OutputParser | None:
    """One choice's parser: reasoning first (the server's), then tool calls (the
    request's plan); None when there is nothing to read and the text is content."""
    tools = plan.make_parser() if plan and plan.make_parser else None
    if tools is None and reasoning is None:
        return None
    return OutputParser(reasoning() if reasoning else None, tools)


def tool_message(
    plan: ToolPlan | None,
    text: str,
    reason: str | None,
    reasoning: type[ReasoningParser] | None = None,
) -> tuple[dict[str, Any], Any]:
    """(the reply's message, its finish_reason) for one choice's whole text."""
    parser = output_parser(plan, reasoning)
    assert parser is not None
    found = parser.extract(text)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": found.content,
        "refusal": None,
        "tool_calls": [call.to_openai() for call in found.tool_calls],
    }
    if reasoning is not None:
        message["reasoning_content"] = found.reasoning
    if plan is None:
        return message, reason
    return message, plan.finish_reason(reason, bool(found.tool_calls))


class ToolStream:
    """The chunks of a streamed reply whose choices are read by output parsers
    (reasoning, tool calls, or both)."""

    def __init__(
        self,
        plan: ToolPlan | None,
        renderer: ChunkRenderer,
        n: int,
        reasoning: type[ReasoningParser] | None = None,
    ) -> None:
        self.plan = plan
        self.renderer = renderer
        parsers = [output_parser(plan, reasoning) for _ in range(n)]
        assert all(p is not None for p in parsers)
        self.parsers: list[OutputParser] = parsers  # type: ignore[assignment]
        self.has_calls = [False] * n

    def chunk(self, index: int, text: str, reason: str | None, logprobs: bytes) -> bytes | None:
        """The chunk for one output of choice `index` (None when the parser holds
        everything back and there is nothing else to say)."""
        parser = self.parsers[index]
        delta = parser.feed(text) if reason is None else parser.finish(text)
        if delta.tool_calls:
            self.has_calls[index] = True
        if not delta and reason is None and logprobs == b"null":
            return None
        body: dict[str, Any] = {}
        if delta.reasoning:
            body["reasoning_content"] = delta.reasoning
        if delta.content:
            body["content"] = delta.content
        if delta.tool_calls:
            body["tool_calls"] = [piece.to_openai() for piece in delta.tool_calls]
        finish = reason
        if self.plan is not None:
            finish = self.plan.finish_reason(reason, self.has_calls[index])
        choice = b'{"index":%d,"delta":%b,"logprobs":%b,"finish_reason":%b}' % (
            index,
            json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode(),
            logprobs,
            finish_json(finish),
        )
        r = self.renderer
        return r.head + b',"choices":[' + choice + b"]" + r.usage_null + b"}\n\n"
