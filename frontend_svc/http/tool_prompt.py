"""How a conversation with tools reaches the chat template.

A template that renders tools itself (its source uses `tools`, as Qwen 2.5's, Hermes' and
Llama 3.1's do) gets what transformers' `apply_chat_template` gives it: `tools` in its context,
assistant messages with `tool_calls` (their arguments as objects) and `tool` messages with their
`tool_call_id`. Any other template (SmolLM2's ChatML knows only role and content) gets plain
messages in the Hermes format, which http/tool_parser.py reads back: the tools listed in the
system message, an assistant's calls as the `<tool_call>` blocks the model is asked to write,
and tool results as a user message of `<tool_response>` blocks (roles any template takes).
"""

from __future__ import annotations

import json
import re
from typing import Any

from frontend_svc.http.tool_parser import CALL_CLOSE, CALL_OPEN
from frontend_svc.http.tools import ToolPlan

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def template_renders_tools(template: str | None) -> bool:
    return template is not None and re.search(r"\btools\b", template) is not None


def calls_are_tagged(template: str | None) -> bool:
    """The model writes a call as a `<tool_call>` block: the Hermes format this server shows a
    template that does not render tools, or one that renders them so (Qwen 2.5, Hermes). Else
    (Llama 3.1) as a bare JSON object."""
    return not template_renders_tools(template) or CALL_OPEN in (template or "")


def template_inputs(
    messages: list[dict[str, Any]], plan: ToolPlan | None, template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages to render and the template context to add (`tools`)."""
    if template_renders_tools(template):
        context = {"tools": plan.shown()} if plan is not None else {}
        return [_with_argument_objects(m) for m in messages], context
    return hermes_messages(messages, plan), {}


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # as sent: the template or the model makes what it can of it


def _with_argument_objects(message: dict[str, Any]) -> dict[str, Any]:
    if not message.get("tool_calls"):
        return message
    calls = []
    for call in message["tool_calls"]:
        function = call["function"]
        calls.append(
            {**call, "function": {**function, "arguments": _arguments(function["arguments"])}}
        )
    return {**message, "tool_calls": calls}


def tools_section(plan: ToolPlan) -> str:
    """The system prompt's part that shows the tools and the format of a call."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in plan.shown())
    how_many = (
        "You may call several functions, one <tool_call> block each."
        if plan.parallel
        else "Call at most one function."
    )
    return (
        "# Tools\n\n"
        "You can call functions to answer the user. They are described as JSON within "
        "<tools></tools>:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, write a JSON object with its name and arguments within "
        f"{CALL_OPEN}{CALL_CLOSE} tags:\n"
        f'{CALL_OPEN}\n{{"name": <function name>, "arguments": <arguments object>}}\n{CALL_CLOSE}\n'
        f"{how_many}"
    )


def hermes_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # call id -> function name, for the results
    results: dict[str, Any] | None = None  # the user message that collects tool results
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "tool":
            block = _tool_result(message, call_names)
            if results is None:
                results = {"role": "user", "content": block}
                out.append(results)
            else:
                results["content"] += "\n" + block
            continue
        results = None
        if role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                name = call["function"]["name"]
                call_names[call["id"]] = name
                shown = {"name": name, "arguments": _arguments(call["function"]["arguments"])}
                blocks.append(f"{CALL_OPEN}\n{json.dumps(shown, ensure_ascii=False)}\n{CALL_CLOSE}")
            content = "\n".join([content, *blocks] if content else blocks)
        out.append({"role": role, "content": content})
    if plan is not None:
        section = tools_section(plan)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _tool_result(message: dict[str, Any], call_names: dict[str, str]) -> str:
    call_id = message.get("tool_call_id")
    noted: dict[str, Any] = {}
    name = message.get("name") or call_names.get(call_id or "")
    if name:
        noted["name"] = name
    if call_id:
        noted["tool_call_id"] = call_id
    noted["content"] = message["content"]
    return f"{RESPONSE_OPEN}\n{json.dumps(noted, ensure_ascii=False)}\n{RESPONSE_CLOSE}"
