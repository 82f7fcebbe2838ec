"""What a chat body's `tools`, `tool_choice` and `parallel_tool_calls` ask for: a ToolPlan.

The plan says which tools the model is shown (http/tool_prompt.py renders them), which output
constraint guarantees a call (`required`: a JSON array of calls, each `{"name", "arguments"}`
matching one tool; a named function: that tool's parameters schema; `auto` beside an output
format: a call or an answer in the format) and which parser reads the calls out of the output
(http/tool_parser.py). `none` shows the tools, as vLLM does by default, and reads no call: the
output is the message content. The legacy `functions` and an `allowed_tools` choice are read
as tools and a choice first (http/tool_choice.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from common.messages import StructuredOutput
from common.structured import MAX_TIMES, Option, any_of
from frontend_svc.http.errors import OpenAIError
from frontend_svc.http.protocol import ChatCompletionRequest, ToolDefinition
from frontend_svc.http.tool_choice import allowed_tools, is_allowed_tools, requested_tools
from frontend_svc.http.tool_parser import CALL_CLOSE, CALL_OPEN, NamedCallParser, ToolCallParser

MAX_TOOLS = 128
CHOICES = ("none", "auto", "required")
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(slots=True, frozen=True)
class ToolPlan:
    tools: tuple[ToolDefinition, ...]
    choice: str  # none | auto | required | function (a named function)
    function_name: str | None = None  # choice == "function"
    parallel: bool = True  # more than one call allowed
    legacy: bool = False  # asked as `functions`: answered as `function_call` (tool_choice.py)

    @property
    def names(self) -> list[str]:
        return [t.function.name for t in self.tools]

    def shown(self) -> list[dict[str, Any]]:
        """The tools as the model is shown them (and as a chat template receives them)."""
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def constraint(self) -> StructuredOutput | None:
        if self.choice == "function":
            tool = next(t for t in self.tools if t.function.name == self.function_name)
            return StructuredOutput("json_schema", json.dumps(_parameters(tool)))
        if self.choice == "required":
            return StructuredOutput("json_schema", json.dumps(calls_schema(self)))
        return None

    def parser(self) -> ToolCallParser | NamedCallParser | None:
        """A new parser for one output; None when the output is read as plain content."""
        if self.choice == "none":
            return None
        if self.choice == "function":
            assert self.function_name is not None
            return NamedCallParser(self.function_name)
        return ToolCallParser(self.names, self.parallel)


def tool_plan(body: ChatCompletionRequest) -> ToolPlan | None:
    """The body's tool plan (None: no tools); a 400 naming the field for anything malformed.
    allowed_tools keeps only the tools it allows."""
    tools, value, legacy = requested_tools(body)
    _check_tools(tools)
    if is_allowed_tools(value):
        choice, allowed = allowed_tools(value, tools)
        tools, name = tuple(t for t in tools if t.function.name in allowed), None
    else:
        choice, name = _choice(value, tools)
    if not tools:
        return None
    parallel = body.parallel_tool_calls is not False and not legacy
    return ToolPlan(tools, choice, name, parallel, legacy)


def tool_constraint(
    plan: ToolPlan | None, asked: tuple[str, StructuredOutput] | None, tagged: bool = True
) -> tuple[str, StructuredOutput] | None:
    """The request's one output constraint and the field it comes from, given the body's other
    one (`asked`, from http/constraints.py):

    - no tools, or `none`: `asked`;
    - `auto`: unconstrained, or with `asked` one grammar for a call or an answer in that format
      (`call_or_answer`; `tagged`: the model writes calls in `<tool_call>` blocks);
    - `required` or a named function: the plan's (`tools`); the output is the call, so `asked`
      shapes no output of this turn, as with OpenAI (and vLLM)."""
    if plan is None or plan.choice == "none":
        return asked
    if plan.choice == "auto":
        return None if asked is None else (asked[0], call_or_answer(plan, asked[1], tagged))
    constraint = plan.constraint()
    return None if constraint is None else ("tools", constraint)


def call_or_answer(plan: ToolPlan, answer: StructuredOutput, tagged: bool) -> StructuredOutput:
    """Either calls, as the model was asked to write them (1 to MAX_TIMES `<tool_call>` blocks,
    one per line, 1 without parallel calls; or one bare call object), or `answer`."""
    call = StructuredOutput("json_schema", json.dumps(call_schema(plan)))
    calls = Option(call)
    if tagged:
        times = MAX_TIMES if plan.parallel else 1
        calls = Option(call, f"{CALL_OPEN}\n", f"\n{CALL_CLOSE}", times, between="\n")
    return any_of([calls, Option(answer)])


def _check_tools(tools: tuple[ToolDefinition, ...]) -> None:
    if len(tools) > MAX_TOOLS:
        raise OpenAIError(400, f"at most {MAX_TOOLS} tools; got {len(tools)}", "tools")
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not FUNCTION_NAME.fullmatch(fn.name):
            raise OpenAIError(
                400,
                f"tools[{i}]: function name {fn.name!r} must be 1 to 64 letters, digits, "
                "underscores or dashes",
                f"tools.{i}.function.name",
            )
        if fn.name in seen:
            raise OpenAIError(
                400, f"tools[{i}]: function {fn.name!r} is declared twice", f"tools.{i}.function"
            )
        seen.add(fn.name)
        if fn.parameters is not None and fn.parameters.get("type", "object") != "object":
            raise OpenAIError(
                400,
                f"tools[{i}]: parameters must be a JSON schema of type object",
                f"tools.{i}.function.parameters",
            )


def _choice(value: Any, tools: tuple[ToolDefinition, ...]) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise OpenAIError(
                400,
                f"tool_choice {value!r} is not one of {', '.join(CHOICES)} or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if value == "required" and not tools:
            raise OpenAIError(400, "tool_choice 'required' needs tools", "tool_choice")
        return value, None
    name = _named_function(value)
    if name not in {t.function.name for t in tools}:
        raise OpenAIError(
            400,
            f"tool_choice names function {name!r}, which is not in tools",
            "tool_choice.function.name",
        )
    return "function", name


def _named_function(value: Any) -> str:
    name = None
    if isinstance(value, dict) and value.get("type") == "function":
        function = value.get("function")
        if isinstance(function, dict):
            name = function.get("name")
    if not isinstance(name, str):
        raise OpenAIError(
            400,
            'tool_choice must be "none", "auto", "required", '
            '{"type": "function", "function": {"name": ...}} or {"type": "allowed_tools", ...}',
            "tool_choice",
        )
    return name


# ---- the constraint of tool_choice "required" ------------------------------------------------
def _parameters(tool: ToolDefinition) -> dict[str, Any]:
    return tool.function.parameters or NO_PARAMETERS


def calls_schema(plan: ToolPlan) -> dict[str, Any]:
    """A JSON array of 1 or more (exactly 1 without parallel calls) calls (`call_schema`)."""
    call = call_schema(plan)
    defs = call.pop("$defs", None)
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": call}
    if not plan.parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def call_schema(plan: ToolPlan) -> dict[str, Any]:
    """One call: an object `{"name": <a tool's name>, "arguments": <that tool's parameters>}`,
    the tools' definitions under its `$defs`."""
    defs: dict[str, Any] = {}
    items = []
    for tool in plan.tools:
        name = tool.function.name
        items.append(
            {
                "type": "object",
                "properties": {
                    "name": {"const": name},
                    "arguments": _hoisted(name, _parameters(tool), defs),
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema: dict[str, Any] = items[0] if len(items) == 1 else {"anyOf": items}
    return {**schema, "$defs": defs} if defs else schema


def _hoisted(name: str, parameters: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """A tool's schema, nested in the array's: its local references (`#/$defs/X`, `#`, ...)
    point at its own root, so a schema that has any moves under the root's `$defs`, each
    definition renamed after the tool, and its references follow."""
    if not _has_local_ref(parameters):
        return parameters
    prefix = f"{name}--"
    moved = _rebased(parameters, prefix)
    for section in ("$defs", "definitions"):
        for key, definition in (moved.pop(section, None) or {}).items():
            defs[prefix + key] = definition
    defs[prefix + "parameters"] = moved
    return {"$ref": f"#/$defs/{prefix}parameters"}


def _has_local_ref(node: Any) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return True
        return any(_has_local_ref(v) for v in node.values())
    if isinstance(node, list):
        return any(_has_local_ref(v) for v in node)
    return False


def _rebased(node: Any, prefix: str) -> Any:
    if isinstance(node, list):
        return [_rebased(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = _rebased_ref(value, prefix)
        else:
            out[key] = _rebased(value, prefix)
    return out


def _rebased_ref(ref: str, prefix: str) -> str:
    for section in ("#/$defs/", "#/definitions/"):
        if ref.startswith(section):
            return f"#/$defs/{prefix}{ref[len(section) :]}"
    return f"#/$defs/{prefix}parameters{ref[1:]}"
