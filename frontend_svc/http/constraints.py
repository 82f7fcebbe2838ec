"""What an OpenAI body asks the output to match: `response_format` (json_object, json_schema)
and vLLM's `structured_outputs` / `guided_json` / `guided_regex` / `guided_choice` /
`guided_grammar`, as one StructuredOutput (common/structured.py compiles it; Intake checks it)."""

from __future__ import annotations

import json
from typing import Any

from common.messages import StructuredOutput
from frontend_svc.http.errors import OpenAIError

GUIDED = {
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
STRUCTURED_KEYS = {
    "json": "json_schema",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
    "json_object": "json_object",
}


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind in ("json_schema", "choice"):
        if isinstance(value, str):
            return StructuredOutput(kind, value)
        return StructuredOutput(kind, json.dumps(value))
    if not isinstance(value, str):
        raise OpenAIError(400, f"{param} must be a string", param)
    return StructuredOutput(kind, value)


def _response_format(fmt: dict[str, Any]) -> tuple[str, StructuredOutput] | None:
    kind = fmt.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return "response_format", StructuredOutput("json_object")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise OpenAIError(
                400,
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                "response_format.json_schema",
            )
        schema = spec.get("schema", {})
        if not isinstance(schema, dict):
            raise OpenAIError(
                400,
                "response_format.json_schema.schema must be a JSON schema (an object)",
                "response_format.json_schema.schema",
            )
        return "response_format.json_schema.schema", StructuredOutput(
            "json_schema", json.dumps(schema)
        )
    raise OpenAIError(
        400,
        f"response_format {kind!r} is not supported; use text, json_object or json_schema",
        "response_format.type",
    )


def constraint(
    body, response_format: dict[str, Any] | None = None
) -> tuple[str, StructuredOutput] | None:
    """The body's one constraint and the field that asked for it, the error's param when it
    does not compile (None: unconstrained); two at once is a 400."""
    found: list[tuple[str, StructuredOutput]] = []
    if response_format:
        fmt = _response_format(response_format)
        if fmt is not None:
            found.append(fmt)
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((field, _spec(kind, value, field)))
    if body.structured_outputs:
        keys = [k for k in body.structured_outputs if k in STRUCTURED_KEYS]
        unknown = set(body.structured_outputs) - set(STRUCTURED_KEYS)
        if unknown or len(keys) != 1:
            raise OpenAIError(
                400,
                "structured_outputs takes exactly one of "
                f"{', '.join(STRUCTURED_KEYS)}; got {', '.join(sorted(body.structured_outputs))}",
                "structured_outputs",
            )
        param = f"structured_outputs.{keys[0]}"
        kind = STRUCTURED_KEYS[keys[0]]
        found.append((param, _spec(kind, body.structured_outputs[keys[0]], param)))
    if len(found) > 1:
        names = ", ".join(name.split(".")[0] for name, _ in found)
        raise OpenAIError(
            400,
            f"ask for one output constraint, not several ({names})",
            found[1][0].split(".")[0],
        )
    return found[0] if found else None
