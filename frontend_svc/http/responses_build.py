"""A /v1/responses body -> the chat completions request it amounts to.

The Responses API runs on the chat pipeline: its input items become chat messages
(`instructions` a system message first, `function_call` items an assistant message's tool_calls,
`function_call_output` items tool messages), its flat function tools chat tools, `text.format` a
response_format and `max_output_tokens` max_completion_tokens. http/build.py then renders,
tokenizes and constrains exactly as for /v1/chat/completions; `renamed` gives its refusals the
names of this body's fields. What this server cannot do (built-in tools, images, background
responses, ...) is refused here with a sentence.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import ChatCompletionRequest
from frontend_svc.http.responses_protocol import (
    ITEM_MODELS,
    TEXT_PARTS,
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputItem,
    MessageItem,
    ResponsesRequest,
)

KEPT_INCLUDES = {"reasoning.encrypted_content"}  # no reasoning items: nothing to add
ALLOWED = (
    '{"type": "allowed_tools", "mode": "auto" | "required", "tools": '
    '[{"type": "function", "name": ...}, ...]}'
)


@dataclass(slots=True)
class Translated:
    chat: ChatCompletionRequest
    conversation: list[dict]  # the stored conversation, then this input, as items
    tools: list[dict]  # the function tools, as the response echoes them


def translate(body: ResponsesRequest, history: list[dict], request_id: str) -> Translated:
    """`history`: the items of the response `previous_response_id` names (already checked)."""
    _refuse_unsupported(body)
    own = [{"type": "message", "role": "user", "content": body.input}]
    if not isinstance(body.input, str):
        own = body.input
        if not own:
            raise OpenAIError(400, "input is empty; send at least one item", "input")
    items = [_item(raw, "previous_response_id") for raw in history]
    items += [_item(raw, f"input.{i}") for i, raw in enumerate(own)]
    messages = _messages(body.instructions, items, len(history))
    tools = [_function_tool(i, raw) for i, raw in enumerate(body.tools or ())]
    payload: dict[str, Any] = {
        "model": body.model,
        "messages": messages,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "max_completion_tokens": body.max_output_tokens,
        "tools": [{"type": "function", "function": _function(t)} for t in tools] or None,
        "tool_choice": _tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body),
        # template variables: a chat template that reads them gets them (http/template_vars.py)
        "reasoning_effort": body.reasoning.effort if body.reasoning is not None else None,
        "verbosity": body.text.verbosity if body.text is not None else None,
        "request_id": request_id,
    }
    chat = ChatCompletionRequest.model_validate({k: v for k, v in payload.items() if v is not None})
    conversation = history + [_stored(item) for item in items[len(history) :]]
    return Translated(chat, conversation, [t.model_dump() for t in tools])


REFUSED = {  # fields this server cannot honour: why, and what to send instead
    "background": "background responses are not supported; wait for the response or stream it",
    "conversation": "conversation objects are not supported; continue with previous_response_id",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "max_tool_calls": "max_tool_calls is not supported; parallel_tool_calls=false allows one call",
    "top_logprobs": "logprobs are not supported on /v1/responses; use /v1/chat/completions",
}


def _refuse_unsupported(body: ResponsesRequest) -> None:
    for param, message in REFUSED.items():
        if getattr(body, param) not in (None, False, 0):
            raise OpenAIError(400, message, param)
    if body.truncation == "auto":
        raise OpenAIError(
            400,
            "truncation 'auto' is not supported: this server drops no input items; send "
            "'disabled' (the default) and an input that fits",
            "truncation",
        )
    for i, name in enumerate(body.include or ()):
        if name not in KEPT_INCLUDES:
            raise OpenAIError(
                400, f"include {name!r} is not supported by this server", f"include.{i}"
            )


def _validated(model: type[BaseModel], value: Any, param: str) -> Any:
    """`value` as `model`; a 400 naming the first field that does not fit."""
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err.get("loc", ()) if not re.search(r"[\[\]]|^(str|int)$", str(x))]
        where = ".".join([param, *loc])
        msg = err.get("msg", "is not valid")
        if err.get("type") == "extra_forbidden":
            msg = "is not a parameter this server knows (check its spelling)"
        raise OpenAIError(400, f"{where}: {msg}", where) from exc


def _item(raw: Any, param: str) -> InputItem:
    kind = raw.get("type", "message") if isinstance(raw, dict) else None
    model = ITEM_MODELS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise OpenAIError(
            400,
            f"{param}: items of type {kind!r} are not supported; this server takes message, "
            "function_call and function_call_output items",
            f"{param}.type",
        )
    return _validated(model, raw, param)


def _text(content: str | list[ContentPart], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for k, part in enumerate(content):
        if part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
            continue
        if part.type not in TEXT_PARTS:
            raise OpenAIError(
                400,
                f"{param}.content.{k}: content parts of type {part.type!r} are not supported; "
                "this server takes text only (input_text, output_text)",
                f"{param}.content.{k}.type",
            )
        if part.text is None:
            raise OpenAIError(
                400, f"{param}.content.{k}: a text part needs its text", f"{param}.content.{k}"
            )
        texts.append(part.text)
    return "\n".join(texts)


def _messages(instructions: str | None, items: list[InputItem], stored: int) -> list[dict]:
    """Chat messages: the calls of one turn (after its text, if any) join one assistant
    message, as a chat completion returns them; a result must answer an earlier call."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    calls: set[str] = set()
    for i, item in enumerate(items):
        param = f"input.{i - stored}" if i >= stored else "previous_response_id"
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": _text(item.content, param)})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            calls.add(item.call_id)
        else:
            if item.call_id not in calls:
                raise OpenAIError(
                    400,
                    f"{param}: no function_call with call_id {item.call_id!r} comes before this "
                    "function_call_output (in the input or the previous response)",
                    f"{param}.call_id",
                )
            content = _text(item.output, param)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": content})
    return messages


def _stored(item: InputItem) -> dict:
    """An input item as the store keeps it: text content as one string."""
    if isinstance(item, MessageItem):
        return {"type": "message", "role": item.role, "content": _text(item.content, "input")}
    if isinstance(item, FunctionCallOutputItem):
        return {
            "type": "function_call_output",
            "call_id": item.call_id,
            "output": _text(item.output, "input"),
        }
    return item.model_dump(exclude_none=True)


def _function_tool(i: int, raw: Any) -> FunctionTool:
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind != "function":
        raise OpenAIError(
            400,
            f"tools.{i}: tools of type {kind!r} are not supported; this server runs function "
            "tools only (built-in tools such as web_search or file_search are OpenAI's)",
            f"tools.{i}.type",
        )
    return _validated(FunctionTool, raw, f"tools.{i}")


def _function(tool: FunctionTool) -> dict:
    return tool.model_dump(exclude={"type"}, exclude_none=True)


def _tool_choice(choice: Any) -> Any:
    """Chat's tool_choice; chat's tool_plan checks the strings, the names and the modes."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") == "allowed_tools":
        mode, tools = choice.get("mode"), choice.get("tools")
        if set(choice) != {"type", "mode", "tools"} or mode not in ("auto", "required"):
            raise OpenAIError(400, f"tool_choice allowed_tools must be {ALLOWED}", "tool_choice")
        return {"type": "allowed_tools", "allowed_tools": {"mode": mode, "tools": tools}}
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str) or len(choice) != 2:
        raise OpenAIError(
            400,
            'tool_choice must be "none", "auto", "required", {"type": "function", "name": ...} '
            f"or allowed_tools; got {choice!r} (built-in tools are not supported)",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


def _response_format(body: ResponsesRequest) -> dict | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    for field, value in (("name", fmt.name), ("schema", fmt.schema_)):
        if value is None:
            raise OpenAIError(
                400, f"text.format json_schema needs its {field}", f"text.format.{field}"
            )
    spec = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": spec}


PARAMS = (  # chat's names -> this body's, first match
    (re.compile(r"^messages\b.*"), "input"),
    (re.compile(r"^tools\.(\d+)\.function\b"), r"tools.\1"),
    (re.compile(r"^tool_choice\.function\.name$"), "tool_choice.name"),
    (re.compile(r"^tool_choice\.allowed_tools\b"), "tool_choice"),
    (re.compile(r"^response_format\.json_schema\.schema\b"), "text.format.schema"),
    (re.compile(r"^response_format\b.*"), "text.format"),
    (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
)
WORDS = (
    ("response_format", "text.format"),
    ("max_completion_tokens", "max_output_tokens"),
    ('{"type": "function", "function": {"name": ...}}', '{"type": "function", "name": ...}'),
    ("allowed_tools.tools", "tools"),
)


def renamed(err: OpenAIError) -> OpenAIError:
    """A refusal of the chat pipeline, its field named as this body spells it."""
    param = err.param
    for pattern, replacement in PARAMS:
        if param is not None and pattern.search(param):
            param = pattern.sub(replacement, param, count=1)
            break
    message = re.sub(r"^messages\b", "input", err.message)
    for old, new in WORDS:
        message = message.replace(old, new)
    return OpenAIError(err.status, message, param, err.code, err.retry_after_s)
