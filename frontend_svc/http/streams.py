"""Consume a request's StreamDeltas while watching for the HTTP client to go away."""

from __future__ import annotations

import asyncio
import json

from starlette.types import Receive

from frontend_svc.client_request import ClientRequest, StreamDelta


def sse(obj: dict | str) -> str:
    """One server-sent event: `data: <json>` and a blank line."""
    data = obj if isinstance(obj, str) else json.dumps(obj, separators=(",", ":"))
    return f"data: {data}\n\n"


class DisconnectWatcher:
    """Reads the ASGI receive channel (the body is already consumed) until the client
    disconnects; `next()` returns the request's next delta, or None once the client is gone."""

    def __init__(self, receive: Receive) -> None:
        self.task = asyncio.get_running_loop().create_task(self._watch(receive))

    @staticmethod
    async def _watch(receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    @property
    def disconnected(self) -> bool:
        return self.task.done()

    async def next(self, state: ClientRequest) -> StreamDelta | None:
        queue = state.queue
        try:
            return queue.take_merged(queue.get_nowait())
        except asyncio.QueueEmpty:
            pass
        if self.task.done():
            return None
        getter = asyncio.ensure_future(state.queue.get())
        try:
            done, _ = await asyncio.wait((getter, self.task), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            getter.cancel()
            raise
        if getter in done:
            return queue.take_merged(getter.result())
        getter.cancel()
        return None

    def close(self) -> None:
        self.task.cancel()
