"""GET /openapi.json: the document FastAPI generates from the routes and protocol.py, corrected
to say what the server answers.

- A refused body is a 400 with errors.py's body (ErrorResponse), not FastAPI's 422 "Validation
  Error" (errors.py answers every RequestValidationError with 400).
- Each operation lists the statuses its code path answers (ANSWERS); 401 wherever the API key
  guards it, 413 wherever it takes a body (the --max-request-bytes cap, server.py), 500 on all.
- The bearer scheme, required where ApiKeyMiddleware requires it: everywhere but app.py's
  OPEN_PATHS. The document itself needs the key as /v1 does: it is neither a probe nor a count.
- Answers that are not JSON: text/event-stream for stream=true, text/plain for /metrics.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from frontend_svc.http.answer_schemas import ANSWER_MODELS
from frontend_svc.http.errors import ErrorResponse

ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
DESCRIPTION = (
    "splitserve's OpenAI-compatible API. Errors have OpenAI's body "
    '{"error": {"message", "type", "param", "code"}}. Any request may also be answered before '
    "it reaches a route: 408 when its head is too slow (--http-header-timeout), 503 when the "
    "server holds its most connections (--http-max-connections)."
)
# what a status means wherever ANSWERS gives no sentence of its own
WHY = {
    400: "The request is not valid: not JSON, a field of the wrong type or out of range, or "
    "refused by the server's checks; `param` names the field.",
    401: "No API key, or a wrong one: send `Authorization: Bearer KEY`.",
    404: "Not found.",
    409: "Conflict.",
    413: "The body is over the server's limit (--max-request-bytes).",
    429: "Overloaded: the queue or the tenant's share is full, or the request cannot meet its "
    "targets now; `Retry-After` says when to try again.",
    500: "An internal error: a bug; the message names the exception.",
    503: "No worker can take the request (none attached, or all draining), or the server is "
    "shutting down; retry later.",
    504: "The answer could not be completed in time: the request was shed after its output "
    "began (--shed-hopeless, ttft_target_s / tpot_target_s).",
}
UNKNOWN_MODEL = "`model` is not a model this server serves."
GENERATION = {400: None, 404: UNKNOWN_MODEL, 429: None, 503: None, 504: None}
# each operation's statuses besides 200, 401, 413 and 500 (added by rule), with why where the
# generic sentence would not say; an operation not listed gets 400 if it reads any input
ANSWERS: dict[str, dict[int, str | None]] = {
    "POST /v1/completions": GENERATION,
    "POST /v1/chat/completions": GENERATION,
    "POST /v1/responses": {
        **GENERATION,
        404: "`model` is not served here, or `previous_response_id` names no kept response.",
    },
    "GET /v1/responses/{response_id}": {404: "No kept response has this id."},
    "DELETE /v1/responses/{response_id}": {404: "No kept response has this id."},
    "GET /v1/models": {},
    "GET /v1/models/{model_id}": {404: "This server serves no model of that name."},
    "POST /tokenize": {400: None, 404: UNKNOWN_MODEL},
    "POST /detokenize": {400: None, 404: UNKNOWN_MODEL},
    "POST /v1/requests/{request_id}/priority": {
        400: None,
        404: "No request with this id is in flight.",
        409: "The request is no longer waiting: its priority cannot change.",
        503: "The scheduler cannot be reached; retry later.",
    },
    "POST /v1/load_lora_adapter": {
        400: "A worker refused the adapter's files (another base model, a rank over "
        "--max-lora-rank, files missing or corrupt: nothing stays loaded), the name is taken, or "
        "no worker serves adapters.",
        503: "The scheduler cannot be reached, or a worker left while loading; retry later.",
    },
    "POST /v1/unload_lora_adapter": {
        400: None,
        404: "No LoRA adapter of this name is loaded.",
        503: "The scheduler cannot be reached; retry later.",
    },
    "GET /health": {},
    "GET /ready": {},  # its 503 has the readiness body: _special_bodies
    "GET /metrics": {404: "Metrics are not enabled on this server."},
    "GET /cluster": {503: "No scheduler leader is connected; retry later."},
    "GET /dashboard": {},
    "GET /dashboard/api/state": {},
    "GET /dashboard/api/events": {400: None},
}
STREAMED = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses")
# one server-sent event as schemathesis and OpenAPI 3.1 read an event stream; the data is a
# chunk as JSON, an error body, or [DONE] (not JSON), so its content is not described further
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
}
READY = {
    "type": "object",
    "required": ["status", "workers"],
    "properties": {
        "status": {"type": "string"},
        "workers": {"type": "array", "items": {"type": "string"}},
    },
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait", "schema": {"type": "string"}}}


def install_openapi(app: FastAPI, guarded: bool, is_open: Callable[[str], bool]) -> None:
    """Serve the corrected document at the app's openapi_url (built once, on first request).
    `guarded`: the server has an API key; `is_open(path)`: the path needs no key."""

    def document() -> dict:
        if app.openapi_schema is None:
            generated = get_openapi(
                title=app.title, version=app.version, description=DESCRIPTION, routes=app.routes
            )
            app.openapi_schema = corrected(generated, guarded, is_open)
        return app.openapi_schema

    app.openapi = document  # type: ignore[method-assign]


def corrected(doc: dict, guarded: bool, is_open: Callable[[str], bool]) -> dict:
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    _add_schemas(schemas, [ErrorResponse, *ANSWER_MODELS.values()])
    components["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "The server's --api-key; required only when the server has one.",
        }
    }
    if guarded:
        doc["security"] = [{"bearer": []}]
    for path, operations in doc.get("paths", {}).items():
        for method, operation in operations.items():
            key = f"{method.upper()} {path}"
            guards = guarded and not is_open(path)
            _declare_errors(key, operation, guards)
            if guarded and not guards:
                operation["security"] = []
            _special_bodies(key, operation["responses"])
    return doc


def _add_schemas(schemas: dict, models: list[type[BaseModel]]) -> None:
    _, defs = models_json_schema(
        [(model, "serialization") for model in models],
        ref_template="#/components/schemas/{model}",
    )
    for name, schema in defs["$defs"].items():
        if schemas.setdefault(name, schema) != schema:
            raise RuntimeError(f"two schemas named {name} in /openapi.json")


def _declare_errors(key: str, operation: dict, guarded: bool) -> None:
    responses = operation["responses"]
    read_input = responses.pop("422", None) is not None
    answers = dict(ANSWERS.get(key, {400: None} if read_input else {}))
    answers[500] = None
    if guarded:
        answers[401] = None
    if "requestBody" in operation:
        answers[413] = None
    for status in sorted(answers):
        declared: dict = {
            "description": answers[status] or WHY[status],
            "content": {"application/json": {"schema": ERROR}},
        }
        if status == 429:
            declared["headers"] = RETRY_AFTER
        if status == 401:
            declared["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        responses[str(status)] = declared


def _special_bodies(key: str, responses: dict) -> None:
    ok = responses.get("200")
    if ok is None:
        return
    if key in ANSWER_MODELS:
        ref = {"$ref": f"#/components/schemas/{ANSWER_MODELS[key].__name__}"}
        ok["content"]["application/json"]["schema"] = ref
    if key in STREAMED:
        ok["description"] = "The answer; with stream=true, server-sent events ending in [DONE]."
        ok.setdefault("content", {})["text/event-stream"] = {"schema": SSE_EVENT}
    elif key == "GET /dashboard/api/events":
        ok["content"] = {"text/event-stream": {"schema": SSE_EVENT}}
    elif key == "GET /metrics":
        ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
        ok["description"] = "Prometheus' text format."
    elif key == "GET /ready":
        ok["content"] = {"application/json": {"schema": READY}}
        responses["503"] = {
            "description": "Not ready: no worker attached, or shutting down.",
            "content": {"application/json": {"schema": READY}},
        }
