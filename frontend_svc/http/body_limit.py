"""The request body cap (--max-request-bytes): 413 before the body is read.

A body announced by Content-Length over the cap is refused at once, without a single receive
(so uvicorn never sends `100 Continue` and an `Expect` client never uploads). A chunked body is
counted as it comes and refused as soon as it passes the cap; the application is then told the
client left. Pure ASGI, as ApiKeyMiddleware: no buffering, and a request with Content-Length
under the cap (every streamed completion) passes without a wrapper at all, since the HTTP parser
never hands on more bytes than Content-Length says.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from frontend_svc.http.errors import error_response

FLAG = "--max-request-bytes"


def declared_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:  # the HTTP parser refuses these first
                return None
    return None


def expects_continue(scope: Scope) -> bool:
    return any(
        name == b"expect" and value.lower() == b"100-continue"
        for name, value in scope.get("headers", ())
    )


async def refuse(scope: Scope, receive: Receive, send: Send, message: str) -> None:
    response = error_response(413, message, None, "request_too_large")
    if expects_continue(scope):  # the body will not follow: the connection has nothing left
        response.headers["Connection"] = "close"
    await response(scope, receive, send)


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes  # 0: no cap

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        declared = declared_length(scope)
        if declared is None:  # chunked (or no body): count what comes
            guard = _CountingGuard(scope, receive, send, self.max_bytes)
            await self.app(scope, guard.receive, guard.send)
        elif declared > self.max_bytes:
            message = (
                f"the request body has {declared} bytes, over this server's limit of "
                f"{self.max_bytes} ({FLAG}); send a smaller body"
            )
            await refuse(scope, receive, send, message)
        else:
            await self.app(scope, receive, send)


class _CountingGuard:
    """receive/send for the application of one request whose size is not announced."""

    __slots__ = ("scope", "_receive", "_send", "max_bytes", "received", "started", "answered")

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_bytes: int) -> None:
        self.scope = scope
        self._receive = receive
        self._send = send
        self.max_bytes = max_bytes
        self.received = 0
        self.started = False  # the application began its response
        self.answered = False  # the 413 went out in its place

    async def receive(self) -> Message:
        if self.received > self.max_bytes:
            return {"type": "http.disconnect"}
        message = await self._receive()
        if message["type"] != "http.request":
            return message
        self.received += len(message.get("body", b""))
        if self.received <= self.max_bytes:
            return message
        if not self.started:
            self.answered = True
            message = (
                f"the request body passed this server's limit of {self.max_bytes} bytes "
                f"({FLAG}); send a smaller body"
            )
            await refuse(self.scope, self._receive, self._send, message)
        # the rest of the body is the HTTP server's to discard; the application stops here
        return {"type": "http.disconnect"}

    async def send(self, message: Message) -> None:
        if self.answered:  # whatever the application makes of the "disconnect" goes nowhere
            return
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)
