"""The API key check shared by HTTP and gRPC, and the gRPC interceptor's refusals."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from frontend_svc.auth import MISSING_KEY, WRONG_KEY, ApiKeyInterceptor, bearer_token, check_key


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None
    assert bearer_token("Bearer") is None and bearer_token("Bearer   ") is None
    assert bearer_token(None) is None and bearer_token("") is None


def test_check_key():
    assert check_key(None, "") is None  # no key configured: open
    assert check_key("Bearer k", "k") is None
    assert check_key(None, "k") == MISSING_KEY
    assert check_key("Basic k", "k") == MISSING_KEY
    assert check_key("Bearer x", "k") == WRONG_KEY
    assert check_key("Bearer k2", "k") == WRONG_KEY


class FakeContext:
    def __init__(self):
        self.aborted = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def details(method: str, key: str | None):
    metadata = (("authorization", f"Bearer {key}"),) if key else ()
    return SimpleNamespace(method=method, invocation_metadata=metadata)


async def _ok(request, context):
    return "ok"


@pytest.mark.parametrize(
    ("method", "key", "allowed"),
    [
        ("/splitserve.v1.Generation/Generate", "k", True),
        ("/splitserve.v1.Generation/Generate", None, False),
        ("/splitserve.v1.Generation/GetServerInfo", "wrong", False),
        ("/grpc.health.v1.Health/Check", None, True),
    ],
)
def test_interceptor_refuses_calls_without_the_key(method, key, allowed):
    refused = []
    interceptor = ApiKeyInterceptor("k", refused.append)
    handler = grpc.unary_unary_rpc_method_handler(_ok)

    async def continuation(_details):
        return handler

    async def main():
        got = await interceptor.intercept_service(continuation, details(method, key))
        if allowed:
            assert got is handler
            return None
        ctx = FakeContext()
        with pytest.raises(grpc.aio.AbortError):
            await got.unary_unary(object(), ctx)
        return ctx.aborted

    aborted = asyncio.run(main())
    if allowed:
        assert not refused
    else:
        assert refused == [method]
        assert aborted[0] == grpc.StatusCode.UNAUTHENTICATED and "API key" in aborted[1]


def test_interceptor_keeps_the_shape_of_streaming_handlers():
    async def stream(request, context):
        yield "x"

    handler = grpc.unary_stream_rpc_method_handler(stream)
    interceptor = ApiKeyInterceptor("k")

    async def continuation(_details):
        return handler

    async def main():
        got = await interceptor.intercept_service(continuation, details("/a.B/C", None))
        assert got.unary_stream is not None and got.unary_unary is None
        ctx = FakeContext()
        with pytest.raises(grpc.aio.AbortError):
            async for _ in got.unary_stream(object(), ctx):
                pass
        return ctx.aborted

    assert asyncio.run(main())[0] == grpc.StatusCode.UNAUTHENTICATED
