"""Run uvicorn inside the scheduler's asyncio loop, next to the gRPC servers, with the limits
every request and connection has: the body cap (body_limit.py), the header timeout and the
connection cap (connection_limits.py)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl

import uvicorn

from common.logging import get_logger
from frontend_svc.http.body_limit import BodyLimitMiddleware
from frontend_svc.http.connection_limits import limited_protocol

log = get_logger("splitserve.http")


class _EmbeddedServer(uvicorn.Server):
    """The scheduler owns SIGINT/SIGTERM; uvicorn must not install its own handlers."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """Bind now, so a taken port fails the scheduler at start with a clear error. With
    reuse_port, several front-end processes share the port (the kernel spreads connections)."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen for HTTP on {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock


class HttpServer:
    def __init__(
        self,
        app,
        host: str,
        port: int,
        graceful_timeout: float = 2.0,
        ssl_certfile: str = "",
        ssl_keyfile: str = "",
        ssl_ca_certs: str = "",
        reuse_port: bool = False,
        *,
        max_request_bytes: int,
        header_timeout: float,
        max_connections: int,
    ) -> None:
        """The three limits as their flags give them (--max-request-bytes,
        --http-header-timeout, --http-max-connections); 0 turns one off."""
        self.sock = bind_socket(host, port, reuse_port)
        self.port = self.sock.getsockname()[1]
        tls = {}
        if ssl_certfile:  # the same certificate as the gRPC client API
            tls = {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile or None}
            if ssl_ca_certs:  # client certificates required, as on gRPC
                tls |= {"ssl_ca_certs": ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED}
        config = uvicorn.Config(
            BodyLimitMiddleware(app, max_request_bytes),
            **tls,
            http=limited_protocol(header_timeout, max_connections),
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=graceful_timeout,
            timeout_keep_alive=30,
        )
        self.server = _EmbeddedServer(config)
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        try:
            await self.task
        finally:
            self.sock.close()
