"""Where the leader scheduler is: a fixed address, or whatever etcd names (with its epoch)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from common.logging import get_logger

if TYPE_CHECKING:
    from common.credentials import Credentials

log = get_logger("splitserve.frontend")


class LeaderFinder(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def next_leader(self, min_epoch: int, timeout: float | None) -> tuple[str, int] | None:
        """(front-end link address, epoch) of a leader no older than min_epoch; None when
        none is named within timeout seconds."""

    async def wait_newer(self, epoch: int) -> None:
        """Return once a leader newer than `epoch` is named."""


class FixedLeader:
    """One scheduler, no etcd: always the same address, epoch 0."""

    def __init__(self, address: str) -> None:
        self.address = address

    async def start(self) -> None:
        """Nothing to watch: the address is fixed."""

    async def stop(self) -> None:
        """Nothing was started."""

    async def next_leader(self, min_epoch: int, timeout: float | None) -> tuple[str, int] | None:
        return self.address, 0

    async def wait_newer(self, epoch: int) -> None:
        await asyncio.Event().wait()


class EtcdLeader:
    """Follows the leader key in etcd (common/coordination.py): with the front-end's
    credentials over mutual TLS, where etcd lets its certificate read that key and no other."""

    def __init__(
        self, endpoint: str, cluster: str = "splitserve", credentials: Credentials | None = None
    ) -> None:
        from common.coordination import Coordinator

        self.coordinator = Coordinator(endpoint, cluster, credentials=credentials)
        self.current = None  # LeaderInfo | None
        self.changed = asyncio.Condition()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        await self.coordinator.connect()
        self._task = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.coordinator.close()

    async def _watch(self) -> None:
        async for leader in self.coordinator.watch_leader():
            async with self.changed:
                self.current = leader
                self.changed.notify_all()

    async def _wait(self, predicate, timeout: float | None) -> bool:
        async with self.changed:
            try:
                await asyncio.wait_for(self.changed.wait_for(predicate), timeout)
            except TimeoutError:
                return False
        return True

    async def next_leader(self, min_epoch: int, timeout: float | None) -> tuple[str, int] | None:
        def named() -> bool:
            return self.current is not None and self.current.epoch >= min_epoch

        if not await self._wait(named, timeout):
            return None
        leader = self.current
        assert leader is not None
        return str(leader.info["frontend_address"]), leader.epoch

    async def wait_newer(self, epoch: int) -> None:
        await self._wait(lambda: self.current is not None and self.current.epoch > epoch, None)
