"""The HTTP server's limits over real sockets against a real HttpServer: the body cap before
the body is read, the header timeout, the connection cap."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from frontend_svc.http import HttpServer

CAP = 64 * 1024
WAIT_S = 30.0  # how long a socket read may wait before the test gives up (never asserted on)


async def app(scope, receive, send) -> None:
    """POST: reads the body, answers its length. GET /slow: answers after 3 header timeouts."""
    if scope["type"] != "http":
        return
    size = 0
    more = True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    if scope["path"] == "/slow":
        await asyncio.sleep(3 * HEADER_TIMEOUT)
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


HEADER_TIMEOUT = 0.3


@contextmanager
def serving(
    header_timeout: float = HEADER_TIMEOUT, max_connections: int = 0, asgi=app
) -> Iterator[int]:
    """A real HttpServer of `asgi` on a loop of its own thread; yields its port."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = HttpServer(
        asgi,
        "127.0.0.1",
        0,
        max_request_bytes=CAP,
        header_timeout=header_timeout,
        max_connections=max_connections,
    )
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(WAIT_S)
    try:
        yield server.port
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(WAIT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(WAIT_S)
        loop.close()


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
    return sock


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    """One response with a Content-Length body (the connection may stay open)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"closed before a response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers.get("content-length", 0)):
        chunk = sock.recv(65536)
        assert chunk, "closed in the middle of a response body"
        body += chunk
    return int(lines[0].split()[1]), headers, body


def post(port: int, body: bytes, sock: socket.socket | None = None) -> tuple[int, bytes]:
    sock = sock or connect(port)
    head = f"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
    sock.sendall(head + body)
    status, _, answer = read_response(sock)
    return status, answer


def test_a_content_length_over_the_cap_is_answered_before_the_body_is_sent():
    with serving() as port, connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 21000000\r\n\r\n")
        status, headers, body = read_response(sock)  # no byte of the body was sent
        assert status == 413 and headers["content-type"] == "application/json"
        error = json.loads(body)["error"]
        assert error["code"] == "request_too_large" and "--max-request-bytes" in error["message"]


def test_a_chunked_body_is_refused_once_it_passes_the_cap_and_the_server_goes_on():
    with serving() as port, connect(port) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"a" * 16384
        for _ in range(CAP // len(chunk) + 1):  # one chunk past the cap, and no end chunk
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        status, _, body = read_response(sock)
        assert status == 413 and "--max-request-bytes" in json.loads(body)["error"]["message"]
        assert post(port, b"b" * CAP) == (200, str(CAP).encode())  # under the cap: served


def test_a_connection_without_a_complete_request_head_is_closed():
    with serving() as port:
        with connect(port) as silent, connect(port) as partial:
            partial.sendall(b"POST / HTTP/1.1\r\nHost: x\r\n")  # never the blank line
            # read_all returns once the server closes the connection
            assert read_all(silent) == b""  # nothing sent: closed without a word
            answer = read_all(partial)
            assert answer.startswith(b"HTTP/1.1 408 ") and b"--http-header-timeout" in answer


def test_the_header_timeout_spares_slow_answers_and_idle_keep_alive():
    with serving() as port, connect(port) as sock:
        sock.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200  # took 3 header timeouts: the head was in time
        threading.Event().wait(3 * HEADER_TIMEOUT)  # idle between requests: keep-alive's part
        assert post(port, b"abc", sock) == (200, b"3")


def test_a_later_request_head_must_arrive_in_time_too():
    with serving() as port, connect(port) as sock:
        assert post(port, b"abc", sock) == (200, b"3")
        sock.sendall(b"POST / HTTP/1.1\r\n")  # a second head, never finished
        assert read_all(sock).startswith(b"HTTP/1.1 408 ")


def test_connections_over_the_cap_get_503_idle_ones_counted():
    with serving(header_timeout=0, max_connections=3) as port:
        idle = [connect(port) for _ in range(3)]  # never send a byte
        try:
            with connect(port) as extra:
                answer = read_all(extra)
            assert answer.startswith(b"HTTP/1.1 503 ")
            error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
            assert "--http-max-connections" in error["message"]
            assert post(port, b"x", idle[0]) == (200, b"1")  # the open ones still serve
        finally:
            for sock in idle:
                sock.close()
        # their slots come back once the server has seen them close
        for _ in range(200):
            with connect(port) as sock:
                sock.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx")
                status, _, _ = read_response(sock)
            if status == 200:
                break
            threading.Event().wait(0.05)
        assert status == 200
