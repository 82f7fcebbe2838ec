"""Response objects of /v1/responses, in the shapes of the official client's types
(openai.types.responses: Response, ResponseOutputMessage, ResponseFunctionToolCall,
ResponseUsage), built from what the chat pipeline produced (http/format.py's message)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from frontend_svc.http.responses_protocol import ResponsesRequest

INCOMPLETE = {"length": "max_output_tokens"}  # finish reason -> incomplete_details.reason
COMPLETED = ("stop", "tool_calls")


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(input_tokens: int, output_tokens: int) -> dict:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def status_of(finish_reason: str | None) -> str:
    """completed, incomplete (cut by max_output_tokens or the context) or failed (ended early:
    aborted, shed, an error)."""
    if finish_reason in COMPLETED:
        return "completed"
    return "incomplete" if finish_reason in INCOMPLETE else "failed"


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [text_part(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(message: dict, status: str) -> list[dict]:
    """A chat message (content, tool_calls) as output items: the text, then each call. The
    last item shares an incomplete response's status (it is the one cut short)."""
    items = []
    if message.get("content") or not message.get("tool_calls"):
        items.append(message_item(new_id("msg"), message.get("content") or "", "completed"))
    for call in message.get("tool_calls") or ():
        function = call["function"]
        items.append(
            call_item(
                new_id("fc"), call["id"], function["name"], function["arguments"], "completed"
            )
        )
    if status == "incomplete":
        items[-1]["status"] = "incomplete"
    return items


@dataclass(slots=True)
class ResponseShape:
    """One response's id, model and times, and what its object echoes of the request."""

    body: ResponsesRequest
    response_id: str
    model: str
    tools: list[dict]  # the function tools, as FunctionTool dumps them
    created_at: int = field(default_factory=lambda: int(time.time()))

    def object(
        self,
        status: str,
        output: list[dict],
        usage: dict | None = None,
        finish_reason: str | None = None,
        error: dict | None = None,
    ) -> dict:
        body = self.body
        incomplete = INCOMPLETE.get(finish_reason) if status == "incomplete" else None
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": incomplete} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "prompt_cache_key": body.prompt_cache_key,
            "reasoning": body.reasoning.model_dump() if body.reasoning else None,
            "safety_identifier": body.safety_identifier,
            "service_tier": "default",
            "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "text": self._text(),
            "tool_choice": "auto" if body.tool_choice is None else body.tool_choice,
            "tools": self.tools,
            "top_logprobs": 0,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": body.user,
            "metadata": body.metadata or {},
        }

    def _text(self) -> dict:
        config = self.body.text
        fmt = config.format if config is not None else None
        text: dict = {"format": {"type": "text"}}
        if fmt is not None:
            text["format"] = fmt.model_dump(by_alias=True, exclude_none=True)
        if config is not None and config.verbosity is not None:
            text["verbosity"] = config.verbosity
        return text
