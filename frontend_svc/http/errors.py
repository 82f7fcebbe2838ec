"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.logging import get_logger

log = get_logger("splitserve.http")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}

# the `code` of an error raised without one: always a string, as OpenAI's API gives it
CODE_FOR_STATUS = {
    400: "invalid_request",
    401: "invalid_api_key",
    403: "permission_denied",
    404: "not_found",
    405: "method_not_allowed",
    408: "timeout",
    409: "conflict",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    499: "cancelled",
    500: "internal_error",
    503: "unavailable",
}

# a StreamDelta's error_code (a grpc.StatusCode name) -> HTTP status
STATUS_FOR_CODE = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "RESOURCE_EXHAUSTED": 429,
    "DEADLINE_EXCEEDED": 504,  # the answer cannot be completed by the request's deadline
    "UNAVAILABLE": 503,
    "CANCELLED": 499,
    # a request id in flight from another client: a front-end apart hears it from the scheduler,
    # an embedded one is refused by submit; both answer 400
    "ALREADY_EXISTS": 400,
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    """Every error's body, in OpenAI's shape; `param` names the field at fault, if one is."""

    # error_body writes it; this model only describes it, in /openapi.json (http/openapi.py)
    error: ErrorDetail


class OpenAIError(Exception):
    """Raised by route code; rendered as OpenAI's error body with this status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    @classmethod
    def from_error_code(cls, error_code: str, message: str) -> OpenAIError:
        status = STATUS_FOR_CODE.get(error_code, 500)
        return cls(status, message, code=error_code.lower() if error_code else None)


def error_body(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": str(code) if code is not None else CODE_FOR_STATUS.get(status, "error"),
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | int | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


UNION_TAGS = {"str", "int", "float", "bool", "none"}
# OpenAI's fields this server knows and cannot honour: refused with the reason, not as unknown
UNSUPPORTED = {
    "web_search_options": "is not supported: this server cannot search the web",
    "audio": "is not supported: this server generates text only",
    "moderation": "is not supported: this server runs no moderation model",
}


def _param(loc) -> str | None:
    """A pydantic error location as OpenAI's `param` ("messages.0.content"): without `body`
    and without the union member a value was tried as (`str`, `list[TextPart]`...)."""
    parts = [
        str(x)
        for x in loc
        if x != "body" and not (isinstance(x, str) and (x in UNION_TAGS or "[" in x))
    ]
    return ".".join(parts) or None


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """A sentence per error (three at most) and the param: the deepest location, since of the
    union members a value was tried as, the one that fits its shape gets furthest in."""
    errors = exc.errors()
    if not errors:
        return "the request body is not valid", None
    if any(err.get("type") == "json_invalid" for err in errors):
        return "the request body is not valid JSON", None
    found: list[tuple[str | None, str]] = []
    for err in errors:
        param = _param(err.get("loc", ()))
        msg = err.get("msg", "is not valid")
        if err.get("type") == "extra_forbidden":
            msg = UNSUPPORTED.get(
                param or "", "is not a parameter this server knows (check its spelling)"
            )
        elif param is None:  # the body itself
            msg = (
                "the request body is empty; send a JSON object"
                if err.get("type") == "missing"
                else "the request body must be a JSON object"
            )
        if (param, msg) not in found:
            found.append((param, msg))
    deepest = max(found, key=lambda f: len(f[0].split(".")) if f[0] else 0)
    found.remove(deepest)
    found.insert(0, deepest)
    parts = [f"{param}: {msg}" if param else msg for param, msg in found[:3]]
    more = f" (and {len(found) - 3} more)" if len(found) > 3 else ""
    return "; ".join(parts) + more, deepest[0]


def install_error_handlers(app: FastAPI, on_invalid: Callable[[], None] | None = None) -> None:
    """`on_invalid`: called for each body refused before a route runs (not JSON, wrong types or
    ranges), as the routes count their own refusals."""

    def invalid() -> None:
        if on_invalid is not None:
            on_invalid()

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        response = error_response(exc.status, exc.message, exc.param, exc.code)
        if exc.retry_after_s is not None:
            response.headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
        return response

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        invalid()
        message, param = _validation_message(exc)
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = (
                f"no route {request.method} {request.url.path}; the API is under /v1 "
                "(/v1/chat/completions, /v1/completions, /v1/responses, /v1/models)"
            )
            return error_response(404, message, None, "not_found")
        if exc.status_code == 405:
            return error_response(
                405, f"{request.method} is not allowed on {request.url.path}", None
            )
        if exc.status_code == 400:  # FastAPI could not read the body (e.g. not UTF-8)
            invalid()
            message = f"the request body is not valid JSON in UTF-8 ({exc.detail})"
            return error_response(400, message, None)
        return error_response(exc.status_code, str(exc.detail), None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("http_internal_error", path=request.url.path)
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", None)
