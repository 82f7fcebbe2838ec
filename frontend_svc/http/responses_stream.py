"""A streamed /v1/responses: the chat pipeline's stream deltas (http/format.py's chunk deltas:
text, and tool calls whose id and name come once, then argument fragments) as Responses events.

Every event is an SSE `event:` line naming its type and a `data:` line with the object, which
carries that type and a sequence_number counting from 0, as OpenAI sends them:

  response.created, response.in_progress
  per output item: response.output_item.added, then for a message
    response.content_part.added, response.output_text.delta..., response.output_text.done,
    response.content_part.done; for a call response.function_call_arguments.delta...,
    response.function_call_arguments.done; then response.output_item.done
  response.completed | response.incomplete | response.failed

One item is open at a time: a call starts a new item and closes the text before it.
"""

from __future__ import annotations

import json

from frontend_svc.http.responses_render import (
    ResponseShape,
    call_item,
    message_item,
    new_id,
    text_part,
)


def event(kind: str, sequence_number: int, fields: dict) -> str:
    data = {"type": kind, "sequence_number": sequence_number, **fields}
    return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class ResponseEvents:
    """The events of one response, in order; `output` is its output items so far. Each event
    is serialized as it is made, so the items can go on growing after."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.sequence = 0
        self.output: list[dict] = []
        self.open: int | None = None  # the output index of the item still growing
        self.calls: dict[int, int] = {}  # a call's index in the chat delta -> its output index
        self.final: dict | None = None  # the response object of response.completed / incomplete

    def _emit(self, kind: str, **fields) -> str:
        text = event(kind, self.sequence, fields)
        self.sequence += 1
        return text

    def start(self) -> list[str]:
        head = self.shape.object("in_progress", [])
        return [
            self._emit("response.created", response=head),
            self._emit("response.in_progress", response=head),
        ]

    def feed(self, delta: dict) -> list[str]:
        """One chat chunk's delta ({"content": ..., "tool_calls": [...]})."""
        out: list[str] = []
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def finish(self, status: str, usage: dict, finish_reason: str | None) -> list[str]:
        """Close the open item (or send an empty message, when nothing came) and end with the
        whole response: response.completed, or response.incomplete."""
        out = [] if self.output else self._text("")
        out += self._close("incomplete" if status == "incomplete" else "completed")
        self.final = self.shape.object(status, self.output, usage, finish_reason)
        return out + [self._emit(f"response.{status}", response=self.final)]

    def fail(self, message: str, code: str = "server_error") -> list[str]:
        out = self._close("incomplete")
        error = {"code": code, "message": message}
        failed = self.shape.object("failed", self.output, error=error)
        return out + [self._emit("response.failed", response=failed)]

    # ---- items ----------------------------------------------------------------------------
    def _add(self, item: dict) -> tuple[int, str]:
        self.output.append(item)
        index = len(self.output) - 1
        self.open = index
        added = self._emit("response.output_item.added", output_index=index, item=item)
        return index, added

    def _text(self, text: str) -> list[str]:
        out: list[str] = []
        item = self.output[self.open] if self.open is not None else None
        if item is None or item["type"] != "message":
            out += self._close("completed")
            index, added = self._add(message_item(new_id("msg"), None, "in_progress"))
            item = self.output[index]
            out.append(added)
            item["content"].append(text_part(""))
            out.append(
                self._emit(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=text_part(""),
                )
            )
        if text:
            item["content"][0]["text"] += text
            out.append(
                self._emit(
                    "response.output_text.delta",
                    item_id=item["id"],
                    output_index=self.open,
                    content_index=0,
                    delta=text,
                    logprobs=[],
                )
            )
        return out

    def _call(self, call: dict) -> list[str]:
        out: list[str] = []
        function = call.get("function") or {}
        fragment = function.get("arguments") or ""
        if call.get("id") is not None:  # a new call: its id and name come once, first
            out += self._close("completed")
            item = call_item(new_id("fc"), call["id"], function.get("name"), "", "in_progress")
            index, added = self._add(item)
            self.calls[call["index"]] = index
            out.append(added)
        index = self.calls.get(call["index"])
        if index is None or not fragment:
            return out
        item = self.output[index]
        item["arguments"] += fragment
        out.append(
            self._emit(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=index,
                delta=fragment,
            )
        )
        return out

    def _close(self, status: str) -> list[str]:
        """The .done events of the open item, which takes `status`."""
        if self.open is None:
            return []
        index, self.open = self.open, None
        item = self.output[index]
        item["status"] = status
        out = []
        if item["type"] == "message":
            part = item["content"][0]
            fields = {"item_id": item["id"], "output_index": index, "content_index": 0}
            out.append(
                self._emit("response.output_text.done", **fields, text=part["text"], logprobs=[])
            )
            out.append(self._emit("response.content_part.done", **fields, part=part))
        else:
            out.append(
                self._emit(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        out.append(self._emit("response.output_item.done", output_index=index, item=item))
        return out
