"""GET /openapi.json: served behind the API key, with the statuses the server answers (400 with
OpenAI's error body, never FastAPI's 422), the bearer scheme, and no body the server refuses."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tests.unit.frontend.test_http_api import run

KEY = "s3cret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR = {"$ref": "#/components/schemas/ErrorResponse"}
CLIENT_BODIES = Path(__file__).resolve().parents[2] / "data" / "client_bodies"


def _document(api_key: str = KEY) -> dict:
    async def body(client, ctx):
        r = await client.get("/openapi.json", headers=AUTH if api_key else {})
        assert r.status_code == 200, r.text
        return r.json()

    return run(body, api_key=api_key)


@pytest.fixture(scope="module")
def doc() -> dict:
    return _document()


def _valid(doc: dict, name: str, value) -> bool:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def _error_body(operation: dict, status: int) -> dict:
    return operation["responses"][str(status)]["content"]["application/json"]["schema"]


def test_the_document_needs_the_key_as_v1_does():
    async def body(client, ctx):
        return [
            (await client.get("/openapi.json", headers=headers)).status_code
            for headers in ({}, {"Authorization": "Bearer wrong"}, AUTH)
        ]

    assert run(body, api_key=KEY) == [401, 401, 200]


def test_the_document_lists_the_api_with_400_and_the_error_body_never_422(doc):
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        operation = paths[path]["post"]
        assert "422" not in operation["responses"]
        for status in (400, 401, 404, 413, 429, 503):
            assert _error_body(operation, status) == ERROR, (path, status)
        assert "text/event-stream" in operation["responses"]["200"]["content"]
    assert "get" in paths["/v1/models"]
    assert not any("422" in op["responses"] for ops in paths.values() for op in ops.values())
    schemas = doc["components"]["schemas"]
    assert "HTTPValidationError" not in schemas and "ValidationError" not in schemas
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert set(schemas["ErrorDetail"]["properties"]) == {"message", "type", "param", "code"}


def test_the_bearer_scheme_is_required_except_on_the_open_paths(doc):
    bearer = doc["components"]["securitySchemes"]["bearer"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    assert doc["security"] == [{"bearer": []}]
    assert doc["paths"]["/health"]["get"]["security"] == []
    assert doc["paths"]["/metrics"]["get"]["security"] == []
    assert "security" not in doc["paths"]["/v1/models"]["get"]  # the document's: the key
    assert "401" in doc["paths"]["/v1/models"]["get"]["responses"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]


def test_without_a_key_nothing_is_required_and_no_401_declared():
    doc = _document(api_key="")
    assert "bearer" in doc["components"]["securitySchemes"]
    assert "security" not in doc
    assert "401" not in doc["paths"]["/v1/completions"]["post"]["responses"]


def test_answers_fit_their_declared_schemas(doc):
    async def body(client, ctx):
        error = await client.post("/v1/completions", json={"prompt": 5}, headers=AUTH)
        done = await client.post("/v1/completions", json={"prompt": "a"}, headers=AUTH)
        return error.json(), done.json()

    error, done = run(body, api_key=KEY)
    assert _valid(doc, "ErrorResponse", error) and _valid(doc, "Completion", done)
    assert not _valid(doc, "ErrorResponse", {"error": {**error["error"], "code": 400}})
    assert not _valid(doc, "Completion", {**done, "choices": [{"index": 0}]})


USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
COMPLETION = ("/v1/completions", "CompletionRequest")
CHAT = ("/v1/chat/completions", "ChatCompletionRequest")
TOKENIZE = ("/tokenize", "TokenizeRequest")


def chat(*messages: dict) -> tuple:
    return (*CHAT, {"messages": list(messages), "max_tokens": 1})


def completion(**fields) -> tuple:
    return (*COMPLETION, {"prompt": "a", "max_tokens": 1, **fields})


# bodies the server refuses; the document must refuse them as well
REFUSED = [
    (*COMPLETION, {"prompt": ""}),
    (*COMPLETION, {"prompt": []}),
    (*COMPLETION, {"prompt": ["a", ""]}),
    (*COMPLETION, {"prompt": [[]]}),
    completion(n=0),
    completion(n=17),
    completion(best_of=0),
    completion(logit_bias={"1": 1.0}),
    completion(suffix="x"),
    completion(priority=10**7),
    completion(prediction={"type": "other", "content": "x"}),
    completion(prediction={"type": "content", "content": [{"type": "image_url"}]}),
    (*CHAT, {"messages": []}),
    chat({"role": "user"}),
    chat({"role": "user", "content": []}),
    chat({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}),
    chat({"role": "user", "content": [{"type": "text"}]}),
    chat({"role": "assistant"}),
    chat({"role": "user", "content": "x", "tool_calls": [CALL]}),
    chat({"role": "user", "content": "x", "tool_call_id": "c1"}),
    chat(*USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "1"}),
    (*TOKENIZE, {}),
    (*TOKENIZE, {"messages": []}),
    (*TOKENIZE, {"prompt": "a", "messages": USER}),
]
ALLOWED = [
    completion(),
    completion(prompt=[[1], [2]]),
    completion(n=2, best_of=2, logit_bias={}, suffix="", priority=-5),
    completion(prediction={"type": "content", "content": [{"type": "text", "text": "x"}]}),
    chat(*USER),
    chat({"role": "user", "content": [{"type": "text", "text": "hi"}]}),
    chat(
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"},
    ),
    (*TOKENIZE, {"prompt": ""}),
    (*TOKENIZE, {"prompt": None, "messages": USER}),
]


@pytest.mark.parametrize(("path", "model", "payload"), REFUSED + ALLOWED)
def test_the_schema_refuses_exactly_the_bodies_the_server_refuses(doc, path, model, payload):
    declared = _valid(doc, model, payload)

    async def body(client, ctx):
        return (await client.post(path, json=payload, headers=AUTH)).status_code

    status = run(body, api_key=KEY)
    assert declared == (status == 200), (payload, status)
    assert declared == ((path, model, payload) in ALLOWED)


def test_the_bodies_real_clients_send_are_allowed(doc):
    """The recorded bodies of instructor, LangChain, pydantic-ai and the Agents SDK (which
    test_client_bodies sends to the server): a schema that refused one would be too strict."""
    recorded = [json.loads(p.read_text()) for p in sorted(CLIENT_BODIES.glob("*/*.json"))]
    assert recorded
    for one in recorded:
        operation = doc["paths"][one["path"]][one["method"].lower()]
        schema = operation["requestBody"]["content"]["application/json"]["schema"]
        errors = jsonschema.Draft202012Validator({**schema, "components": doc["components"]})
        assert not list(errors.iter_errors(one["body"])), (one["path"], one["body"])
