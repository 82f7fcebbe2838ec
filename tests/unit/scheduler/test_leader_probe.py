"""A standby deposes a leader whose process is gone without waiting out its lease, and a frozen
one as soon as its lease has expired, without waiting for etcd's sweep; never one that renewed
in time (scheduler_svc/ha/leader_probe.py, against a real etcd where etcd's behaviour matters)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

from common.coordination import Coordinator, LeaderInfo, cancel_and_wait
from scheduler_svc.ha import leader_probe
from scheduler_svc.ha.leader_probe import depose_dead_leaders
from tests.unit.common.test_coordination import _read_line

ROOT = Path(__file__).resolve().parents[3]
# far longer than the test runs: a takeover inside it can only come from the probe
LONG_TTL = 60.0

# a leader in its own process: it listens on a port it names as its worker_address, as a
# scheduler does, and leads until it is killed
LEADER = """
import asyncio, json, sys
from common.coordination import Coordinator
from common.logging import configure_logging

async def main():
    configure_logging("warning")
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    coord = Coordinator(sys.argv[1], sys.argv[2], lease_ttl=float(sys.argv[3]))
    await coord.connect()
    leadership = await coord.campaign("old", {"worker_address": f"127.0.0.1:{port}"})
    print(json.dumps({"epoch": leadership.epoch}), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


def test_standby_deposes_a_killed_leader_and_not_a_frozen_one(etcd):
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    child = subprocess.Popen(
        [sys.executable, "-c", LEADER, etcd.endpoint, cluster, str(LONG_TTL)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        old_epoch = json.loads(_read_line(child, 15))["epoch"]

        async def scenario() -> None:
            standby = Coordinator(etcd.endpoint, cluster, lease_ttl=LONG_TTL)
            await standby.connect()
            probe = asyncio.create_task(depose_dead_leaders(standby, "new"))
            campaign = asyncio.create_task(standby.campaign("new", {}))
            try:
                # frozen: its sockets stay open, so only its (long) lease could end it
                os.kill(child.pid, signal.SIGSTOP)
                await asyncio.sleep(2.0)
                assert not campaign.done()
                assert (await standby.leader()).epoch == old_epoch
                # killed: its port closes and refuses, so the standby revokes its lease
                os.kill(child.pid, signal.SIGKILL)
                leadership = await asyncio.wait_for(campaign, 20)
                assert leadership.epoch > old_epoch and leadership.valid()
                assert (await standby.leader()).member_id == "new"
                await leadership.resign()
            finally:
                await cancel_and_wait([probe, campaign])
                await standby.close()

        asyncio.run(asyncio.wait_for(scenario(), 40))
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()


def test_a_leader_that_names_no_address_is_left_to_its_lease(etcd):
    async def scenario() -> None:
        cluster = f"test-{uuid.uuid4().hex[:8]}"
        leader, standby = (Coordinator(etcd.endpoint, cluster, lease_ttl=LONG_TTL) for _ in "ab")
        await leader.connect()
        await standby.connect()
        leading = await leader.campaign("old", {})
        probe = asyncio.create_task(depose_dead_leaders(standby, "new"))
        await asyncio.sleep(0.5)
        assert not probe.done() and leading.valid()
        assert (await standby.leader()).epoch == leading.epoch
        await cancel_and_wait([probe])
        await leading.resign()
        await leader.close()
        await standby.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))


class ScriptedLease:
    """A coordinator whose leader's lease reads (seconds left, seconds granted) as scripted,
    the last read repeating; it records whom it deposed."""

    def __init__(self, *reads: tuple[int, int]) -> None:
        self.reads = list(reads)
        self.deposed: list[int] = []

    async def lease_left(self, lease_id: int) -> tuple[int, int]:
        return self.reads.pop(0) if len(self.reads) > 1 else self.reads[0]

    async def depose(self, leader: LeaderInfo) -> None:
        self.deposed.append(leader.epoch)


def _watch_lease(coord: ScriptedLease) -> None:
    leader = LeaderInfo(7, "old", {}, lease_id=42)
    asyncio.run(asyncio.wait_for(leader_probe._depose_when_expired(coord, leader), 20))


def test_a_lease_renewed_after_reading_zero_is_left_and_one_that_stays_zero_is_revoked(
    monkeypatch,
):
    monkeypatch.setattr(leader_probe, "LEASE_POLL_S", 0.0)
    # under a second left, then renewed in time; later under a second again, and expired
    coord = ScriptedLease((1, 2), (0, 2), (1, 2), (1, 2), (0, 2), (0, 2))
    _watch_lease(coord)
    assert coord.deposed == [7]
    assert coord.reads == [(0, 2)]  # every read was taken: the renewal was seen, not skipped


def test_a_lease_already_gone_or_too_short_to_tell_is_left_to_etcd(monkeypatch):
    monkeypatch.setattr(leader_probe, "LEASE_POLL_S", 0.0)
    for coord in (ScriptedLease((1, 2), (-1, 0)), ScriptedLease((0, 1))):
        _watch_lease(coord)
        assert coord.deposed == []


def test_etcd_reads_a_lease_as_the_standby_relies_on(etcd):
    """Seconds left truncated (a fresh 2 s lease reads 1), 0 from under a second left until
    etcd's sweep revokes it, and no renewal once it has expired."""

    async def scenario() -> None:
        coord = Coordinator(etcd.endpoint, f"test-{uuid.uuid4().hex[:8]}", lease_ttl=2.0)
        await coord.connect()
        lease = await coord.client.lease(2)
        assert await coord.lease_left(lease.id) == (1, 2)
        while (await coord.lease_left(lease.id))[0] > 0:
            await asyncio.sleep(0.02)
        await asyncio.sleep(1.0 + leader_probe._CLOCK_SLACK_S)  # past its expiry
        assert (await coord.lease_left(lease.id))[0] in (0, -1)
        reply = await coord.client.refresh_lease(lease.id)
        assert reply is None or reply.TTL <= 0
        assert (await coord.lease_left(lease.id))[0] == -1
        await coord.close()

    asyncio.run(asyncio.wait_for(scenario(), 20))
