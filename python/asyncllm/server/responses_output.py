"""A Responses API response built from one turn's deltas: its output items
(reasoning, message, function calls, in the order the model wrote them) and,
when streamed, the typed events that describe each step —

    response.created, response.in_progress,
    per item: response.output_item.added,
      reasoning:  response.reasoning_text.delta ... .done
      message:    response.content_part.added, response.output_text.delta ...
                  response.output_text.done, response.content_part.done
      call:       response.function_call_arguments.delta ... .done
    response.output_item.done,
    response.completed (or response.incomplete when max_output_tokens cut it).

A non-streamed response is the same builder with its events dropped, so the two
always agree."""

from __future__ import annotations

import json
import secrets
from typing import Any

from asyncllm.server.output_parser import OutputDelta
from asyncllm.server.tool_parsers import ToolCallDelta
from asyncllm.server.turn import TurnEnd


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def sse(kind: str, payload: dict[str, Any]) -> bytes:
    data = json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n".encode()


class ResponseBuilder:
    """Made per response with its constant fields (`head`); `start`, then
    `delta` for each OutputDelta and `end` once, each returning the SSE events
    to send (ignored when not streaming)."""

    def __init__(self, head: dict[str, Any]) -> None:
        self.head = head
        self.output: list[dict[str, Any]] = []
        self.usage: dict[str, Any] | None = None
        self.status = "in_progress"
        self.incomplete: dict[str, str] | None = None
        self._seq = 0
        self._open: dict[str, Any] | None = None  # the item being written
        self._text: list[str] = []  # the open item's text (or arguments) so far
        self._calls: dict[int, int] = {}  # tool call index -> output index

    def body(self) -> dict[str, Any]:
        """The response object as it stands."""
        return {
            **self.head,
            "status": self.status,
            "incomplete_details": self.incomplete,
            "output": self.output,
            "usage": self.usage,
        }

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return sse(kind, payload)

    def start(self) -> list[bytes]:
        body = self.body()
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def delta(self, d: OutputDelta) -> list[bytes]:
        events: list[bytes] = []
        if d.reasoning:
            if self._kind() != "reasoning":
                events += self._close()
                events += self._add({"type": "reasoning", "summary": [], "content": []}, "rs")
            events.append(self._piece("response.reasoning_text.delta", d.reasoning, 0))
        if d.content:
            if self._kind() != "message":
                events += self._close()
                events += self._open_message()
            events.append(self._piece("response.output_text.delta", d.content, 0, logprobs=[]))
        for piece in d.tool_calls:
            events += self._call_piece(piece)
        return events

    def end(self, end: TurnEnd) -> list[bytes]:
        events = self._close()
        cached = end.num_cached_tokens or 0
        self.usage = {
            "input_tokens": end.num_prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": end.num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": end.num_reasoning_tokens},
            "total_tokens": end.num_prompt_tokens + end.num_output_tokens,
        }
        if end.finish_reason in ("stop", "tool_calls"):
            self.status = "completed"
            events.append(self._event("response.completed", response=self.body()))
        else:
            self.status = "incomplete"
            reason = "max_output_tokens" if end.finish_reason == "length" else "interrupted"
            self.incomplete = {"reason": reason}
            events.append(self._event("response.incomplete", response=self.body()))
        return events

    # -- items -----------------------------------------------------------------------

    def _kind(self) -> str | None:
        return None if self._open is None else self._open["type"]

    def _add(self, item: dict[str, Any], prefix: str) -> list[bytes]:
        item = {"id": item_id(prefix), **item}
        if item["type"] != "reasoning":
            item["status"] = "in_progress"
        self._open = item
        self._text = []
        self.output.append(item)
        return [
            self._event(
                "response.output_item.added", output_index=len(self.output) - 1, item=dict(item)
            )
        ]

    def _open_message(self) -> list[bytes]:
        events = self._add({"type": "message", "role": "assistant", "content": []}, "msg")
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._item_event("response.content_part.added", content_index=0, part=part))
        return events

    def _item_event(self, kind: str, **fields: Any) -> bytes:
        assert self._open is not None
        index = len(self.output) - 1
        return self._event(kind, item_id=self._open["id"], output_index=index, **fields)

    def _piece(self, kind: str, text: str, content_index: int, **extra: Any) -> bytes:
        self._text.append(text)
        return self._item_event(kind, content_index=content_index, delta=text, **extra)

    def _call_piece(self, piece: ToolCallDelta) -> list[bytes]:
        events: list[bytes] = []
        if piece.id is not None:
            events += self._close()
            item = {"type": "function_call", "call_id": piece.id, "name": piece.name}
            events += self._add({**item, "arguments": ""}, "fc")
            self._calls[piece.index] = len(self.output) - 1
        if piece.arguments and self._calls.get(piece.index) == len(self.output) - 1:
            self._text.append(piece.arguments)
            events.append(
                self._item_event("response.function_call_arguments.delta", delta=piece.arguments)
            )
        return events

    def _close(self) -> list[bytes]:
        """Finish the open item: its `.done` events and `response.output_item.done`."""
        item = self._open
        if item is None:
            return []
        self._open = None
        text = "".join(self._text)
        events = []
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events.append(self._item_event_for(item, "response.reasoning_text.done", text=text))
        elif item["type"] == "message":
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            events.append(self._item_event_for(item, "response.output_text.done", text=text))
            events.append(self._item_event_for(item, "response.content_part.done", part=part))
        else:
            item["arguments"] = text
            events.append(
                self._item_event_for(
                    item, "response.function_call_arguments.done", arguments=text, name=item["name"]
                )
            )
        if "status" in item:
            item["status"] = "completed"
        index = self.output.index(item)
        events.append(self._event("response.output_item.done", output_index=index, item=item))
        return events

    def _item_event_for(self, item: dict[str, Any], kind: str, **fields: Any) -> bytes:
        index = self.output.index(item)
        extra: dict[str, Any] = {} if item["type"] == "function_call" else {"content_index": 0}
        if item["type"] == "message" and "text" in fields:
            extra["logprobs"] = []
        return self._event(kind, item_id=item["id"], output_index=index, **extra, **fields)
