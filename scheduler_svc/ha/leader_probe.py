"""A standby's eye on the leader, so that a leader that died or froze is not waited out
longer than its lease.

The lease alone would notice a dead leader only when its TTL runs out, and etcd deletes an
expired lease's keys only on its next expiry sweep (about twice a second) after that. Two
watches run while another scheduler leads:

- its process: a plain TCP connection to the leader's internal port. When the leader's process
  dies, its kernel closes that connection at once; if a new connection to the same address is
  then refused, nothing listens there any more. A frozen leader (SIGSTOP) keeps its sockets
  open, and an unreachable host refuses nothing: both are left to the lease.
- its lease: read from etcd every LEASE_POLL_S. etcd reports whole seconds left, truncated, so
  the first 0 means under a second was left when it answered: unless the leader renews it, the
  lease has expired a second after that answer, and etcd refuses to renew an expired lease. A
  0 read again from then on proves it expired (a renewal would restore more than a second of a
  lease granted two or more), without waiting for etcd's sweep.

Either way the standby revokes the leader's lease (Coordinator.depose), which deletes the leader
key and lets the election go on. Fencing makes this safe even if the standby were wrong: a live
leader whose lease is revoked stops acting, as on any lease loss.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno

from common.coordination import TRANSIENT, Coordinator, LeaderInfo, cancel_and_wait
from common.logging import get_logger

log = get_logger("splitserve.leader_probe")
CONNECT_TIMEOUT_S = 1.0
MIN_CONNECTION_S = 0.5
# after a connection that ended quickly: the first retry soon (a dying process's listening
# socket can still take a connection after the old one closed), then slower up to the minimum
FIRST_RETRY_S = 0.02
# a connection attempt ending with one of these proves no process listens at the address
_GONE = (errno.ECONNREFUSED, errno.EHOSTUNREACH)
# how often a standby reads the leader's lease: how late after its expiry it may be deposed
LEASE_POLL_S = 0.1
# the wait from etcd's first "0 s left" to the read that proves expiry is a second by etcd's
# clock: this much more covers our timer firing a hair early
_CLOCK_SLACK_S = 0.01


async def depose_dead_leaders(coord: Coordinator, own_id: str) -> None:
    """Runs while this scheduler is a standby: watches every leader in turn."""
    watching: list[asyncio.Task[None]] = []
    try:
        async with contextlib.aclosing(coord.watch_leader()) as leaders:
            async for leader in leaders:
                await cancel_and_wait(watching)
                watching = []
                if leader is not None and leader.member_id != own_id:
                    watching = [
                        asyncio.create_task(_depose_when_gone(coord, leader)),
                        asyncio.create_task(_depose_when_expired(coord, leader)),
                    ]
    finally:
        await cancel_and_wait(watching)


async def _depose_when_gone(coord: Coordinator, leader: LeaderInfo) -> None:
    address = leader.info.get("worker_address", "")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    host = host.strip("[]")
    loop = asyncio.get_running_loop()
    retry_s = FIRST_RETRY_S
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S
            )
        except OSError as exc:
            if exc.errno in _GONE:
                break
            await asyncio.sleep(CONNECT_TIMEOUT_S)  # inconclusive: the lease decides
            continue
        except TimeoutError:
            continue
        opened_at = loop.time()
        try:
            # nothing is ever sent: the reads end when the leader's side closes (its process
            # died, or its server dropped an idle connection after the handshake timeout); what
            # a plaintext server sends first (its HTTP/2 settings) is read and dropped
            while await reader.read(4096):
                pass
        except OSError:
            pass
        finally:
            writer.close()
        if loop.time() - opened_at < MIN_CONNECTION_S:  # a server that hangs up at once
            await asyncio.sleep(retry_s)
            retry_s = min(MIN_CONNECTION_S, 2 * retry_s)
        else:
            retry_s = FIRST_RETRY_S
    log.warning(
        "leader_process_gone", member_id=leader.member_id, epoch=leader.epoch, address=address
    )
    await _depose(coord, leader)


async def _depose_when_expired(coord: Coordinator, leader: LeaderInfo) -> None:
    if not leader.lease_id:
        return
    loop = asyncio.get_running_loop()
    confirming = False
    while True:
        try:
            left, granted = await coord.lease_left(leader.lease_id)
        except TRANSIENT:  # etcd away: nothing could be revoked either
            confirming = False
            await asyncio.sleep(LEASE_POLL_S)
            continue
        answered = loop.time()
        if left < 0 or granted < 2:  # gone already, or too short to tell renewed from expired
            return
        if left > 0:
            confirming = False
            await asyncio.sleep(LEASE_POLL_S)
        elif confirming:
            break
        else:
            confirming = True
            await asyncio.sleep(answered + 1.0 + _CLOCK_SLACK_S - loop.time())
    log.warning("leader_lease_expired", member_id=leader.member_id, epoch=leader.epoch)
    await _depose(coord, leader)


async def _depose(coord: Coordinator, leader: LeaderInfo) -> None:
    try:
        await coord.depose(leader)
    except TRANSIENT as exc:  # etcd away too: the lease runs out by itself
        log.warning("depose_failed", error=str(exc))
