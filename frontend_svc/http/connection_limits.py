"""Two limits uvicorn's HTTP/1.1 server lacks, added to its protocol class.

- Header timeout (--http-header-timeout): a connection must send a complete request head within
  that many seconds of opening, and each later request's head within as many seconds of its
  first byte (the idle time between requests is uvicorn's keep-alive timeout). Otherwise it is
  closed: with a 408 when part of a head came, silently when nothing did (as nginx does).
  uvicorn arms no timer before the first request, so a connection that never sends one stays
  open for good.
- Connection cap (--http-max-connections): uvicorn's limit_concurrency counts idle connections,
  but only answers 503 once a request head arrives; the connections themselves are held (each a
  file descriptor). Here a connection over the cap gets a 503 when it opens and is closed.
"""

from __future__ import annotations

import asyncio
import json
import time

from uvicorn.protocols.http.auto import AutoHTTPProtocol

from common.logging import get_logger
from frontend_svc.http.errors import error_body

log = get_logger("splitserve.http")

REFUSED_LINGER_S = 1.0  # a refused connection stays this long to read its 503 before the close
WARN_EVERY_S = 10.0


def raw_response(status: int, reason: str, message: str, extra: str = "") -> bytes:
    """A whole HTTP/1.1 response written straight to the socket (no request to answer yet),
    in OpenAI's error shape; the connection closes after it."""
    body = json.dumps(error_body(status, message)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode("latin-1") + body


def limited_protocol(header_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP/1.1 protocol (h11, or httptools where installed) with both limits;
    0 turns either off."""
    timed_out = raw_response(
        408,
        "Request Timeout",
        f"the request head did not arrive within {header_timeout:g} s (--http-header-timeout)",
    )
    full = raw_response(
        503,
        "Service Unavailable",
        f"this server has {max_connections} connections open, its limit "
        "(--http-max-connections); retry later",
        "retry-after: 1\r\n",
    )
    warned = [0.0]  # when a refusal was last logged: one line per WARN_EVERY_S under a flood

    class LimitedProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_timer: asyncio.TimerHandle | None = None
            self._refused = False
            self._awaiting_head = True  # no request head since the last response (or ever)
            self._seen_cycle = None  # the last request the protocol parsed a head for
            self._silent = True  # not a byte received yet
            if max_connections and len(self.connections) > max_connections:
                self._refuse()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return  # read and dropped, so that the close is a clean one
            self._silent = False
            super().data_received(data)
            self._track_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.cycle is self._seen_cycle:  # the next request starts with its first byte
                self._awaiting_head = True
            else:  # a pipelined head was already waiting
                self._track_head()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _track_head(self) -> None:
            if self.cycle is not self._seen_cycle:  # the protocol parsed a complete head
                self._seen_cycle = self.cycle
                self._awaiting_head = False
                self._disarm()
            elif self._awaiting_head and self._head_timer is None:
                self._arm()

        def _arm(self) -> None:
            if header_timeout > 0:
                self._head_timer = self.loop.call_later(header_timeout, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if not self.transport.is_closing():
                if not self._silent:  # a client that began a request learns why it ended
                    self.transport.write(timed_out)
                self.transport.close()

        def _refuse(self) -> None:
            self.connections.discard(self)  # it no longer counts against the cap
            self._refused = True
            now = time.monotonic()
            if now - warned[0] >= WARN_EVERY_S:
                warned[0] = now
                log.warning("http_connection_refused", max_connections=max_connections)
            self.transport.write(full)
            if self.transport.can_write_eof():
                # a close with the client's request unread would reset the connection and could
                # lose the 503 on the way: end our side, read theirs a moment, then close
                self.transport.write_eof()
                self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
            else:
                self.transport.close()

    return LimitedProtocol
