"""The tool-calling parts of a chat request (OpenAI's shapes): the function tools
offered to the model and `tool_choice`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from asyncllm.chat_template import MAX_TOOLS

__all__ = ["MAX_TOOLS", "ChatTool", "FunctionDefinition", "NamedToolChoice", "ToolChoice"]


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # OpenAI's rule for function names: they go into prompts and schemas verbatim.
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class ChatTool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """`{"type": "function", "function": {"name": ...}}`: call this function."""

    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
