"""The optional API key: `Authorization: Bearer KEY` on HTTP, `authorization` metadata on gRPC.

With no key configured everything is open. With one, every client call needs it except the
health checks (gRPC `grpc.health.v1.Health`, HTTP `/health` and `/ready`) and the read-only
operational pages over HTTP (`/metrics`, `/dashboard`), which carry counts, never prompts or
outputs. Workers and front-ends do not use this key: they prove themselves to the scheduler by
mutual TLS (common/link_auth.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/",)
MISSING_KEY = (
    "this server requires an API key; send the header 'Authorization: Bearer <key>' "
    "(gRPC: metadata 'authorization: Bearer <key>')"
)
WRONG_KEY = "the API key is not valid; check --api-key / SPLITSERVE_API_KEY on the server"


def bearer_token(header: str | None) -> str | None:
    """The key in 'Bearer KEY' (scheme case-insensitive), or None when there is none."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def check_key(header: str | None, api_key: str) -> str | None:
    """None when the header carries `api_key` (or no key is configured), else a sentence."""
    if not api_key:
        return None
    token = bearer_token(header)
    if token is None:
        return MISSING_KEY
    if not hmac.compare_digest(token.encode(), api_key.encode()):
        return WRONG_KEY
    return None


def _metadata_value(details: grpc.HandlerCallDetails, key: str) -> str | None:
    for k, v in details.invocation_metadata or ():
        if k == key:
            return v.decode(errors="replace") if isinstance(v, bytes) else v
    return None


def _refusal(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def deny(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def deny_stream(request_or_iterator, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # pragma: no cover - makes this an async generator

    kwargs = dict(
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(deny, **kwargs)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(deny_stream, **kwargs)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(deny, **kwargs)
    return grpc.stream_stream_rpc_method_handler(deny_stream, **kwargs)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the right `authorization: Bearer KEY` metadata."""

    def __init__(self, api_key: str, on_refused: Callable[[str], None] | None = None) -> None:
        self.api_key = api_key
        self.on_refused = on_refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        problem = check_key(_metadata_value(handler_call_details, "authorization"), self.api_key)
        if problem is None:
            return handler
        if self.on_refused is not None:
            self.on_refused(method)
        return _refusal(handler, problem)
