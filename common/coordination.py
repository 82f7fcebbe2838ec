"""Scheduler leader election and membership over etcd (aetcd, asyncio).

The leader is whoever created the leader key under its lease in an etcd transaction; nothing
else decides. The key's create_revision is the leader's epoch: etcd revisions only grow, so a
later leader always carries a greater epoch (the fencing token workers and front-ends check).

Keys, JSON values:  /{cluster}/leader                      {"member_id", "info"}
                    /{cluster}/members/{kind}/{member_id}  info

With a role's credentials the client speaks mutual TLS and etcd knows it by its certificate
(common/etcd_client.py, common/etcd_auth.py): only a scheduler's may write. Without, it speaks
plaintext, and only to an etcd on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import aetcd
import grpc

from common.credentials import Credentials
from common.etcd_client import EtcdClient, denied, refused
from common.logging import get_logger

log = get_logger("coordination")

# etcd restarting shows as any of these; campaign(), register(), update(), watch_leader() and
# the keepalives retry them
TRANSIENT = (aetcd.ClientError, grpc.RpcError, TimeoutError, OSError)
_UNREACHABLE = (aetcd.ConnectionFailedError, aetcd.ConnectionTimeoutError, TimeoutError)
_RETRY_S = 0.2
_CHANNEL_OPTIONS = {
    # gRPC's default reconnect backoff (1 s growing to 120 s) would outlast a lease after an
    # etcd restart
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.min_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 500,
    # pings notice a vanished etcd host under an idle watch; etcd refuses pings under 5 s apart
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.http2.max_pings_without_data": 0,
}
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class LeaderInfo:
    epoch: int  # the leader key's create_revision: strictly increasing across leaders
    member_id: str
    info: dict
    # the lease the key lives under (revoking it deposes that leader); not part of equality
    lease_id: int = field(default=0, compare=False)


def _leader_info(kv: aetcd.KeyValue | None) -> LeaderInfo | None:
    if kv is None:
        return None
    value = json.loads(kv.value)
    return LeaderInfo(kv.create_revision, value["member_id"], value["info"], kv.lease)


async def cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancels the tasks until they are done: asyncio.wait_for in Python 3.11 (aetcd uses it
    too) drops a cancellation that arrives just as its inner future completes."""
    while pending := [task for task in tasks if not task.done()]:
        for task in pending:
            task.cancel()
        await asyncio.wait(pending, timeout=0.1)


def _failed(event: str, failures: int, exc: BaseException, **fields: object) -> None:
    # the first failure of a streak only: an etcd outage would log every retry otherwise
    if failures == 1:
        log.warning(event, error=str(exc) or type(exc).__name__, **fields)


class Coordinator:
    def __init__(
        self,
        endpoint: str,
        cluster: str = "splitserve",
        lease_ttl: float = 2.0,
        credentials: Credentials | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.lease_ttl = lease_ttl
        self.credentials = credentials
        self.client = EtcdClient.at(
            endpoint, credentials, timeout=lease_ttl, options=_CHANNEL_OPTIONS
        )
        self._root = f"/{cluster}"
        self._leader_key = f"{self._root}/leader".encode()
        self._holders: set[Leadership | Membership] = set()
        self._background: set[asyncio.Task[None]] = set()

    @property
    def lease_seconds(self) -> int:
        return max(1, math.ceil(self.lease_ttl))  # etcd grants whole seconds

    async def connect(self, timeout: float = 10.0) -> None:
        """Waits until etcd answers a read of the leader key; ConnectionError after `timeout`
        seconds, PermissionError at once if etcd refuses this certificate that read."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                await self.client.get(self._leader_key)
                return
            except TRANSIENT as exc:
                if denied(exc):
                    raise refused(self.endpoint, "read the leader key", self.credentials) from exc
                if time.monotonic() > deadline:
                    raise ConnectionError(f"etcd at {self.endpoint} does not answer") from exc
                await asyncio.sleep(_RETRY_S)

    async def close(self) -> None:
        """Stops the keepalives without resigning or leaving: the leases expire on their own."""
        for holder in list(self._holders):
            await holder._stop("coordinator closed")
        await cancel_and_wait(list(self._background))
        with contextlib.suppress(TimeoutError):  # a shutdown must not hang on the watch stream
            await asyncio.wait_for(self.client.close(), self.lease_ttl)

    async def campaign(self, member_id: str, info: dict) -> Leadership:
        """Returns once this member created the leader key; waits on a watch while another
        member holds it."""
        value = json.dumps({"member_id": member_id, "info": info}).encode()
        while True:
            won, kv, lease_id, granted_at = await self.retrying(
                "campaign", lambda: self._try_lead(value)
            )
            if won:
                log.info("leader_elected", member_id=member_id, epoch=kv.create_revision)
                return Leadership(self, kv.create_revision, lease_id, granted_at)
            await self._revoke(lease_id)
            async with contextlib.aclosing(self.watch_leader()) as leaders:
                async for leader in leaders:
                    if leader is None:
                        log.info("leader_vacant", member_id=member_id)
                        break

    async def leader(self) -> LeaderInfo | None:
        kv, _ = await self._read_leader()
        return _leader_info(kv)

    async def lease_left(self, lease_id: int) -> tuple[int, int]:
        """(seconds left, seconds granted) of a lease, as etcd says them: whole seconds, the
        left truncated, so 0 when under a second is left, and also once it has expired until
        etcd's next sweep revokes it; -1 left once it is gone."""
        reply = await self.client.get_lease_info(lease_id, keys=False)
        return reply.TTL, reply.grantedTTL

    async def depose(self, leader: LeaderInfo) -> None:
        """Revokes that leader's lease, which deletes its key: for a member that knows the
        leader's process is gone, so the next one need not wait out the TTL. Safe against a
        live leader too: it loses the role and stops acting, as on any lease loss."""
        log.warning("leader_deposed", member_id=leader.member_id, epoch=leader.epoch)
        await self._revoke(leader.lease_id, retry_for=self.lease_ttl)

    async def watch_leader(self) -> AsyncIterator[LeaderInfo | None]:
        """The current leader first, then each change (None: no leader). An etcd outage is
        not a change: the key is read again and watched anew once etcd is back."""
        last: LeaderInfo | None | str = "unset"
        failures = 0
        while True:
            try:
                kv, revision = await self._read_leader()
                failures = 0
                current = _leader_info(kv)
                if current != last:
                    last = current
                    yield current
                watch = await self.client.watch(self._leader_key, start_revision=revision + 1)
                try:
                    async for event in watch:
                        deleted = event.kind == aetcd.EventKind.DELETE
                        current = None if deleted else _leader_info(event.kv)
                        if current != last:
                            last = current
                            yield current
                finally:
                    await watch.cancel()
            except TRANSIENT as exc:
                failures += 1
                _failed("leader_watch_retry", failures, exc)
                await asyncio.sleep(_RETRY_S)

    async def register(self, kind: str, member_id: str, info: dict) -> Membership:
        membership = Membership(self, f"{self._root}/members/{kind}/{member_id}".encode(), info)
        await self.retrying("register", membership._register)
        membership._task = asyncio.create_task(membership._keep_alive())
        self._holders.add(membership)
        return membership

    async def members(self, kind: str) -> list[dict]:
        prefix = f"{self._root}/members/{kind}/".encode()
        result = await self.client.get_prefix(prefix)
        return [
            {**json.loads(kv.value), "member_id": kv.key[len(prefix) :].decode()} for kv in result
        ]

    async def put_json(self, name: str, value: dict) -> None:
        """A plain key (no lease: it outlives its writer) under /{cluster}/."""
        await self.client.put(f"{self._root}/{name}".encode(), json.dumps(value).encode())

    async def get_json(self, name: str) -> dict | None:
        kv = await self.client.get(f"{self._root}/{name}".encode())
        return json.loads(kv.value) if kv is not None else None

    async def retrying(self, what: str, attempt: Callable[[], Awaitable[T]]) -> T:
        """attempt() until etcd answers it; a refusal for this certificate is not retried."""
        failures = 0
        while True:
            try:
                return await attempt()
            except TRANSIENT as exc:
                if denied(exc):
                    raise refused(self.endpoint, what, self.credentials) from exc
                failures += 1
                _failed("etcd_retry", failures, exc, what=what)
                await asyncio.sleep(_RETRY_S)

    async def _try_lead(self, value: bytes) -> tuple[bool, aetcd.Get, int, float]:
        """Creates the leader key under a new lease if absent. Returns whether it did, the
        key as it is after, the lease and when it was asked for."""
        tx, key = self.client.transactions, self._leader_key
        granted_at = time.monotonic()  # the lease's clock starts no earlier than this
        lease = await self.client.lease(self.lease_seconds)
        won, responses = await self.client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, value, lease=lease.id), tx.get(key)],
            failure=[tx.get(key)],
        )
        return won, responses[-1][0][1], lease.id, granted_at

    async def _read_leader(self) -> tuple[aetcd.KeyValue | None, int]:
        # a range read, unlike get(), reports the store's revision when the key is absent
        result = await self.client.get_range(self._leader_key, self._leader_key + b"\0")
        return next(iter(result), None), result.header.revision

    async def _revoke(self, lease_id: int, retry_for: float = 0.0) -> None:
        deadline = time.monotonic() + retry_for
        while True:
            try:
                await self.client.revoke_lease(lease_id)
                return
            except _UNREACHABLE:
                if time.monotonic() > deadline:
                    return
                await asyncio.sleep(_RETRY_S)
            except TRANSIENT:  # the lease is gone already
                return

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class Leadership:
    """Holding the leader key. A leader checks valid() before each act that needs the role."""

    __slots__ = ("epoch", "lost", "_coord", "_lease_id", "_renewed_at", "_tasks")

    def __init__(self, coord: Coordinator, epoch: int, lease_id: int, renewed_at: float) -> None:
        self.epoch = epoch
        self.lost = asyncio.Event()
        self._coord = coord
        self._lease_id = lease_id
        # when the last successful keepalive was *sent*: the lease lives at least lease_ttl
        # from then, however late the reply
        self._renewed_at = renewed_at
        self._tasks = [asyncio.create_task(self._keep_alive()), asyncio.create_task(self._watch())]
        coord._holders.add(self)

    def valid(self) -> bool:
        elapsed = time.monotonic() - self._renewed_at
        return not self.lost.is_set() and elapsed < self._coord.lease_ttl

    async def resign(self) -> None:
        """Deletes the leader key if it is still ours, and revokes the lease."""
        await self._stop("resigned")
        client, key = self._coord.client, self._coord._leader_key
        try:
            await client.transaction(
                compare=[client.transactions.create(key) == self.epoch],
                success=[client.transactions.delete(key)],
                failure=[],
            )
            await client.revoke_lease(self._lease_id)
        except TRANSIENT as exc:
            log.warning("resign_incomplete", epoch=self.epoch, error=str(exc))
        except asyncio.CancelledError:
            # the call, not this task, was cancelled: lead() closed the client once the
            # leadership it watches ended (by this very resign); the lease expires by itself
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            log.warning("resign_incomplete", epoch=self.epoch, error="client closed")

    async def _stop(self, reason: str) -> None:
        self._set_lost(reason)
        await cancel_and_wait(self._tasks)

    def _set_lost(self, reason: str) -> None:
        self._coord._holders.discard(self)
        if not self.lost.is_set():
            log.warning("leadership_lost", epoch=self.epoch, reason=reason)
            self.lost.set()
        for task in self._tasks:
            if task is not asyncio.current_task():
                task.cancel()

    def _lose(self, reason: str) -> None:
        self._set_lost(reason)
        # etcd extends every lease when it restarts: without the revoke, the key could block
        # the next leader for a whole TTL after an outage
        self._coord._spawn(self._coord._revoke(self._lease_id, retry_for=60.0))

    async def _keep_alive(self) -> None:
        ttl, failures = self._coord.lease_ttl, 0
        while not self.lost.is_set():
            left = self._renewed_at + ttl - time.monotonic()
            if left <= 0:  # checked first: after a freeze the lease may be gone already
                self._lose(f"no keepalive succeeded for {ttl} s")
                return
            sent = time.monotonic()
            try:
                refresh = self._coord.client.refresh_lease(self._lease_id)
                reply = await asyncio.wait_for(refresh, min(ttl / 4, left))
            except TRANSIENT as exc:
                failures += 1
                _failed("leader_keepalive_failed", failures, exc, epoch=self.epoch)
            else:
                if reply is None or reply.TTL <= 0:
                    self._lose("lease expired")
                    return
                self._renewed_at, failures = sent, 0
            left = self._renewed_at + ttl - time.monotonic()
            await asyncio.sleep(max(0.0, min(ttl / 4, left)))

    async def _watch(self) -> None:
        async with contextlib.aclosing(self._coord.watch_leader()) as leaders:
            async for leader in leaders:
                if self.lost.is_set():
                    return
                if leader is None or leader.epoch != self.epoch:
                    self._lose("leader key deleted or replaced")
                    return


class Membership:
    """A member's key under its own lease; registered again with a new lease if the old one
    expired (the member was cut off from etcd for longer than the TTL)."""

    __slots__ = ("_coord", "_key", "_value", "_lease_id", "_task")

    def __init__(self, coord: Coordinator, key: bytes, info: dict) -> None:
        self._coord = coord
        self._key = key
        self._value = json.dumps(info).encode()
        self._lease_id = 0
        self._task: asyncio.Task[None] | None = None

    async def update(self, info: dict) -> None:
        self._value = json.dumps(info).encode()
        await self._coord.retrying("member update", self._publish)

    async def leave(self) -> None:
        await self._stop("left")
        try:
            await self._coord.client.delete(self._key)
            await self._coord.client.revoke_lease(self._lease_id)
        except TRANSIENT as exc:
            log.warning("leave_incomplete", key=self._key.decode(), error=str(exc))

    async def _stop(self, reason: str) -> None:
        self._coord._holders.discard(self)
        if self._task is not None:
            await cancel_and_wait([self._task])

    async def _register(self) -> None:
        self._lease_id = (await self._coord.client.lease(self._coord.lease_seconds)).id
        await self._publish()

    async def _publish(self) -> None:
        await self._coord.client.put(self._key, self._value, lease=self._lease_id)

    async def _keep_alive(self) -> None:
        interval, failures = self._coord.lease_ttl / 4, 0
        while True:
            await asyncio.sleep(interval)
            try:
                refresh = self._coord.client.refresh_lease(self._lease_id)
                reply = await asyncio.wait_for(refresh, interval)
                if reply is None or reply.TTL <= 0:
                    log.warning("member_lease_expired", key=self._key.decode())
                    await self._register()
                failures = 0
            except TRANSIENT as exc:
                failures += 1
                _failed("member_keepalive_failed", failures, exc, key=self._key.decode())
