"""The other shapes a chat body asks for tools in, read as `tools` and `tool_choice`
(http/tools.py makes the plan):

- the legacy `functions` / `function_call`: the functions as tools, `function_call` "none",
  "auto" or `{"name": ...}` as that tool_choice; one call at most, answered as the legacy
  `message.function_call` (http/format.py);
- `tool_choice: {"type": "allowed_tools", "allowed_tools": {"mode", "tools"}}`: only the named
  tools can be called (`required`: one must be). The model is shown only those, so the prompt
  holds no tool it cannot call.
"""

from __future__ import annotations

from typing import Any

from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import ToolDefinition

ALLOWED_MODES = ("auto", "required")
ALLOWED_SHAPE = (
    '{"type": "allowed_tools", "allowed_tools": {"mode": "auto" | "required", "tools": '
    '[{"type": "function", "function": {"name": ...}}, ...]}}'
)


def requested_tools(body: Any) -> tuple[tuple[ToolDefinition, ...], Any, bool]:
    """The body's tools, its tool_choice, and whether they came as the legacy fields."""
    functions = getattr(body, "functions", None)
    function_call = getattr(body, "function_call", None)
    tools = tuple(getattr(body, "tools", None) or ())
    choice = getattr(body, "tool_choice", None)
    if functions is None and function_call is None:
        return tools, choice, False
    if tools or choice is not None:
        raise OpenAIError(
            400,
            "send tools and tool_choice, or the legacy functions and function_call, not both",
            "functions" if functions is not None else "function_call",
        )
    tools = tuple(ToolDefinition(type="function", function=f) for f in functions or ())
    return tools, _legacy_choice(function_call, {t.function.name for t in tools}), True


def _legacy_choice(value: Any, names: set[str]) -> Any:
    if value is None or value in ("none", "auto"):
        return value
    name = value.get("name") if isinstance(value, dict) else None
    if not isinstance(name, str):
        raise OpenAIError(
            400, 'function_call must be "none", "auto" or {"name": ...}', "function_call"
        )
    if name not in names:
        raise OpenAIError(
            400,
            f"function_call names function {name!r}, which is not in functions",
            "function_call.name",
        )
    return {"type": "function", "function": {"name": name}}


def is_allowed_tools(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "allowed_tools"


def allowed_tools(value: dict, tools: tuple[ToolDefinition, ...]) -> tuple[str, frozenset[str]]:
    """An allowed_tools choice's mode and the names it allows, each one of `tools`."""
    spec = value.get("allowed_tools")
    listed = spec.get("tools") if isinstance(spec, dict) else None
    if not isinstance(listed, list) or spec.get("mode") not in ALLOWED_MODES:
        raise OpenAIError(
            400, f"tool_choice allowed_tools must be {ALLOWED_SHAPE}", "tool_choice.allowed_tools"
        )
    if not listed:
        raise OpenAIError(
            400,
            "tool_choice allowed_tools.tools is empty; name at least one tool "
            "(tool_choice 'none' allows none)",
            "tool_choice.allowed_tools.tools",
        )
    known = {t.function.name for t in tools}
    names = set()
    for i, entry in enumerate(listed):
        param = f"tool_choice.allowed_tools.tools.{i}"
        name = _allowed_name(entry)
        if name is None:
            raise OpenAIError(
                400,
                f"tool_choice allowed_tools.tools[{i}] must be "
                '{"type": "function", "function": {"name": ...}}',
                param,
            )
        if name not in known:
            raise OpenAIError(
                400,
                f"tool_choice allowed_tools.tools[{i}] names function {name!r}, which is not in "
                "tools",
                param,
            )
        names.add(name)
    return spec["mode"], frozenset(names)


def _allowed_name(entry: Any) -> str | None:
    """`{"type": "function", "function": {"name": N}}`, or the Responses API's flat
    `{"type": "function", "name": N}`."""
    if not isinstance(entry, dict) or entry.get("type") != "function":
        return None
    function = entry.get("function")
    name = function.get("name") if isinstance(function, dict) else entry.get("name")
    return name if isinstance(name, str) else None
