"""A standby's eye on the leader's process, so that a leader that died need not be waited out.

The lease alone would notice a dead leader only when its TTL runs out (etcd checks expiry about
twice a second on top of that). A standby holds a plain TCP connection to the leader's
internal port instead: when the leader's process dies, its kernel closes that connection at
once. If a new connection to the same address is then refused, nothing listens there any more,
and the standby revokes the leader's lease (Coordinator.depose), which deletes the leader key and
lets the election go on. A frozen leader (SIGSTOP) keeps its sockets open, and an unreachable
host refuses nothing: both still wait for the lease, which is what fencing is built for.
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


async def depose_dead_leaders(coord: Coordinator, own_id: str) -> None:
    """Runs while this scheduler is a standby: watches every leader in turn."""
    watching: asyncio.Task[None] | None = None
    try:
        async with contextlib.aclosing(coord.watch_leader()) as leaders:
            async for leader in leaders:
                if watching is not None:
                    await cancel_and_wait([watching])
                    watching = None
                if leader is not None and leader.member_id != own_id:
                    watching = asyncio.create_task(_depose_when_gone(coord, leader))
    finally:
        if watching is not None:
            await cancel_and_wait([watching])


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
    try:
        await coord.depose(leader)
    except TRANSIENT as exc:  # etcd away too: the lease runs out by itself
        log.warning("depose_failed", error=str(exc))
