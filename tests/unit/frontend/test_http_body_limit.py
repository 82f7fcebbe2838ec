"""BodyLimitMiddleware as pure ASGI: 413 before the body is read, and everything under the cap
(streams and disconnects too) passed on untouched."""

from __future__ import annotations

import asyncio
import json

from frontend_svc.http.body_limit import BodyLimitMiddleware

CAP = 1000


def scope(headers: dict[str, str]) -> dict:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "headers": [(k.encode(), v.encode()) for k, v in headers.items()],
    }


class Client:
    """The server side of one request: the messages it hands the app, what the app sent."""

    def __init__(self, chunks: list[bytes], then_disconnect: bool = False) -> None:
        self.messages = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        if then_disconnect:
            self.messages.append({"type": "http.disconnect"})
        self.taken = 0
        self.sent: list[dict] = []

    async def receive(self) -> dict:
        self.taken += 1
        return self.messages[self.taken - 1]

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    def status(self) -> int:
        return self.sent[0]["status"]

    def json(self) -> dict:
        return json.loads(b"".join(m.get("body", b"") for m in self.sent[1:]))


class ReadingApp:
    """Reads the whole body, then answers with it streamed in `parts` chunks; notes what it
    received and whether it was told the client left."""

    def __init__(self, parts: int = 1) -> None:
        self.parts = parts
        self.body = b""
        self.disconnected = False
        self.called = False

    async def __call__(self, scope, receive, send) -> None:
        self.called = True
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.disconnected = True
                await send({"type": "http.response.start", "status": 400, "headers": []})
                await send({"type": "http.response.body", "body": b"gone"})
                return
            self.body += message.get("body", b"")
            if not message.get("more_body"):
                break
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(self.parts):
            last = i == self.parts - 1
            await send({"type": "http.response.body", "body": b"x", "more_body": not last})


def call(headers: dict[str, str], client: Client, app: ReadingApp) -> None:
    asyncio.run(BodyLimitMiddleware(app, CAP)(scope(headers), client.receive, client.send))


def test_a_content_length_over_the_cap_is_413_before_any_receive():
    app, client = ReadingApp(), Client([b"y" * (CAP + 1)])
    call({"content-length": str(21_000_000)}, client, app)
    assert not app.called and client.taken == 0
    assert client.status() == 413
    error = client.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert "--max-request-bytes" in error["message"] and "21000000" in error["message"]
    headers = dict(client.sent[0]["headers"])
    assert b"connection" not in headers  # the body that follows is drained, the 413 read


def test_an_expect_100_continue_client_gets_its_413_and_a_closed_connection():
    app, client = ReadingApp(), Client([])
    call({"content-length": str(CAP + 1), "expect": "100-continue"}, client, app)
    assert client.status() == 413 and dict(client.sent[0]["headers"])[b"connection"] == b"close"


def test_a_chunked_body_is_refused_as_soon_as_it_passes_the_cap():
    chunks = [b"a" * 400, b"b" * 400, b"c" * 400, b"d" * 400]
    app, client = ReadingApp(), Client(chunks)
    call({"transfer-encoding": "chunked"}, client, app)
    assert client.taken == 3  # the chunk that passed the cap; the fourth is never asked for
    assert app.disconnected  # the app is told the client left ...
    assert [m["type"] for m in client.sent] == ["http.response.start", "http.response.body"]
    assert client.status() == 413  # ... and what it sends then goes nowhere
    assert "--max-request-bytes" in client.json()["error"]["message"]


def test_bodies_under_the_cap_and_their_streamed_answers_pass_untouched():
    for headers, chunks in (
        ({"content-length": str(CAP)}, [b"z" * CAP]),
        ({"transfer-encoding": "chunked"}, [b"z" * 500, b"z" * 500]),
    ):
        app, client = ReadingApp(parts=50), Client(chunks)
        call(headers, client, app)
        assert app.body == b"z" * CAP and not app.disconnected
        assert client.status() == 200
        assert [m.get("body") for m in client.sent[1:]] == [b"x"] * 50


def test_a_disconnect_reaches_an_app_waiting_on_the_client():
    async def waiting_app(scope, receive, send):
        first = await receive()
        second = await receive()
        seen.extend([first["type"], second["type"]])

    seen: list[str] = []
    for headers in ({"content-length": "3"}, {}):
        client = Client([b"abc"], then_disconnect=True)
        asyncio.run(
            BodyLimitMiddleware(waiting_app, CAP)(scope(headers), client.receive, client.send)
        )
    assert seen == ["http.request", "http.disconnect"] * 2


def test_zero_turns_the_cap_off():
    app, client = ReadingApp(), Client([b"q" * (CAP * 3)])
    headers = {"content-length": str(CAP * 3)}
    asyncio.run(BodyLimitMiddleware(app, 0)(scope(headers), client.receive, client.send))
    assert client.status() == 200 and len(app.body) == CAP * 3
