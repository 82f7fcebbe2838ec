"""The leader in etcd, watched from threaded code (the worker's link runs on threads): a
daemon thread with an event loop of its own runs Coordinator.watch_leader() and hands each
change to a callback."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from common.coordination import Coordinator, LeaderInfo
from common.credentials import Credentials
from common.etcd_client import require_tls_beyond_loopback
from common.logging import get_logger

log = get_logger("coordination")


class LeaderWatcherThread:
    """Coordinator.watch_leader() on a daemon thread with its own event loop, for threaded
    code. on_change runs on that thread, for the first value too."""

    def __init__(
        self,
        endpoint: str,
        on_change: Callable[[LeaderInfo | None], None],
        cluster: str = "splitserve",
        credentials: Credentials | None = None,
    ) -> None:
        require_tls_beyond_loopback(endpoint, credentials)  # here, not on the thread
        self._endpoint = endpoint
        self._cluster = cluster
        self._credentials = credentials
        self._on_change = on_change
        self._changed = threading.Condition()
        self._current: LeaderInfo | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leader-watcher", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._running.wait()

    def stop(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        # cancelled again while alive: a single cancellation can be dropped (cancel_and_wait)
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self._loop is not None:
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    self._loop.call_soon_threadsafe(self._cancel)
            self._thread.join(0.1)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def current(self) -> LeaderInfo | None:
        with self._changed:
            return self._current

    def wait_for_leader(self, timeout: float | None) -> LeaderInfo | None:
        with self._changed:
            self._changed.wait_for(lambda: self._current is not None, timeout)
            return self._current

    def _run(self) -> None:
        asyncio.run(self._main())

    def _cancel(self) -> None:  # on the loop's thread
        if self._task is not None and not self._closing:
            self._task.cancel()

    async def _main(self) -> None:
        self._loop, self._task = asyncio.get_running_loop(), asyncio.current_task()
        self._running.set()
        coord = Coordinator(self._endpoint, self._cluster, credentials=self._credentials)
        try:
            async with contextlib.aclosing(coord.watch_leader()) as leaders:
                async for leader in leaders:
                    with self._changed:
                        self._current = leader
                        self._changed.notify_all()
                    try:
                        self._on_change(leader)
                    except Exception:
                        log.exception("leader_on_change_failed")
        except asyncio.CancelledError:
            pass
        finally:
            self._closing = True
            await coord.close()
