"""Leader election and membership against a real etcd (common/etcd_server.py) through aetcd:
over mutual TLS with etcd's auth on, as `splitserve up`, compose and Kubernetes run it, and in
plaintext on loopback (the `etcd` fixture)."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import selectors
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest

from common.coordination import Coordinator, LeaderInfo, cancel_and_wait
from common.credentials import Credentials, create_cluster
from common.etcd_auth import ensure_auth_blocking
from common.etcd_server import EtcdServer
from common.leader_watcher import LeaderWatcherThread

ROOT = Path(__file__).resolve().parents[3]
TTL = 2.0


@pytest.fixture(scope="module")
def credentials(tmp_path_factory) -> Path:
    """A cluster's credentials (common/credentials.py): one directory per role."""
    return create_cluster(tmp_path_factory.mktemp("credentials"))


def role(credentials: Path, name: str) -> Credentials:
    return Credentials.load(credentials / name, name)


@pytest.fixture(scope="module")
def secure_etcd(credentials: Path) -> Iterator[EtcdServer]:
    """etcd over mutual TLS with its auth on, as `splitserve up` starts it."""
    server = EtcdServer(
        unsafe_no_fsync=True,
        credentials=role(credentials, "etcd"),
        root_credentials=role(credentials, "root"),
    )
    server.start()
    yield server
    server.stop()


def grant_cluster(etcd: EtcdServer, credentials: Path) -> str:
    """A fresh cluster name, with the roles' permissions on its keys."""
    cluster = f"test-{uuid.uuid4().hex[:8]}"
    ensure_auth_blocking(etcd.endpoint, role(credentials, "root"), cluster)
    return cluster


@pytest.fixture
def cluster(secure_etcd: EtcdServer, credentials: Path) -> str:
    return grant_cluster(secure_etcd, credentials)


def _run(
    etcd: EtcdServer,
    cluster: str,
    scenario: Callable[..., Awaitable[None]],
    coordinators: int,
    credentials: Credentials | None,
) -> None:
    """Runs scenario(*coordinators) with a deadline; whatever it leaves running is stopped."""

    async def main() -> None:
        coords = [
            Coordinator(etcd.endpoint, cluster, lease_ttl=TTL, credentials=credentials)
            for _ in range(coordinators)
        ]
        try:
            for coord in coords:
                await coord.connect()
            await asyncio.wait_for(scenario(*coords), 20)
        finally:
            await cancel_and_wait(
                [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            )
            for coord in coords:
                await coord.close()

    asyncio.run(main())


async def _eventually(check: Callable[[], object], timeout: float = 5.0) -> None:
    """Waits until check() (a plain or an async function) returns true."""
    deadline = time.monotonic() + timeout
    while not await _maybe_await(check()):
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


async def _maybe_await(value: object) -> object:
    return await value if inspect.isawaitable(value) else value


@pytest.mark.parametrize("link", ["mutual-tls", "plaintext-on-loopback"])
def test_one_of_two_candidates_leads_and_the_other_takes_over_with_a_greater_epoch(
    request, credentials, link
):
    if link == "mutual-tls":
        etcd, scheduler = request.getfixturevalue("secure_etcd"), role(credentials, "scheduler")
        cluster = grant_cluster(etcd, credentials)
    else:
        etcd, scheduler = request.getfixturevalue("etcd"), None
        cluster = f"test-{uuid.uuid4().hex[:8]}"

    async def scenario(a: Coordinator, b: Coordinator) -> None:
        campaigns = {
            "a": asyncio.create_task(a.campaign("a", {"host": "ha"})),
            "b": asyncio.create_task(b.campaign("b", {"host": "hb"})),
        }
        await asyncio.wait(campaigns.values(), return_when=asyncio.FIRST_COMPLETED)
        await asyncio.sleep(0.3)
        assert sum(task.done() for task in campaigns.values()) == 1
        first = next(name for name, task in campaigns.items() if task.done())
        second = "b" if first == "a" else "a"
        leading = campaigns[first].result()
        assert leading.valid()
        assert await a.leader() == LeaderInfo(leading.epoch, first, {"host": f"h{first}"})

        await leading.resign()
        assert leading.lost.is_set() and not leading.valid()
        following = await asyncio.wait_for(campaigns[second], 5)
        assert following.epoch > leading.epoch and following.valid()
        assert (await b.leader()).member_id == second
        await following.resign()
        assert await a.leader() is None

    _run(etcd, cluster, scenario, 2, scheduler)


# a leader in its own process, so that SIGSTOP freezes its event loop and nothing else
FROZEN_LEADER = """
import asyncio, json, sys, time
from common.coordination import Coordinator
from common.credentials import Credentials
from common.logging import configure_logging

async def main():
    configure_logging("warning")  # to stderr: stdout carries the JSON lines
    credentials = Credentials.load(sys.argv[4], "scheduler")
    coord = Coordinator(sys.argv[1], sys.argv[2], float(sys.argv[3]), credentials)
    await coord.connect()
    leadership = await coord.campaign("frozen", {})
    print(json.dumps({"epoch": leadership.epoch}), flush=True)
    previous = time.monotonic()
    while time.monotonic() - previous < 1.0:  # ticks until the first one after the freeze
        previous = time.monotonic()
        await asyncio.sleep(0.01)
    woke = {"valid": leadership.valid(), "lost": leadership.lost.is_set()}
    await asyncio.wait_for(leadership.lost.wait(), 5)
    woke["lost_soon"] = leadership.lost.is_set()
    print(json.dumps(woke), flush=True)
    await coord.close()

asyncio.run(main())
"""


def _read_line(process: subprocess.Popen[str], timeout: float) -> str:
    assert process.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        assert selector.select(timeout), "no output from the child in time"
    return process.stdout.readline()


def test_frozen_leader_is_replaced_and_finds_itself_lost_when_it_wakes(
    secure_etcd, cluster, credentials
):
    etcd, scheduler = secure_etcd, credentials / "scheduler"
    child = subprocess.Popen(
        [sys.executable, "-c", FROZEN_LEADER, etcd.endpoint, cluster, str(TTL), str(scheduler)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        frozen_epoch = json.loads(_read_line(child, 15))["epoch"]

        async def scenario(standby: Coordinator) -> None:
            campaign = asyncio.create_task(standby.campaign("standby", {}))
            await asyncio.sleep(0.3)
            assert not campaign.done()
            os.kill(child.pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            leadership = await asyncio.wait_for(campaign, 3 * TTL)
            takeover_s = time.monotonic() - frozen_at
            os.kill(child.pid, signal.SIGCONT)
            print(f"takeover {takeover_s:.2f} s after the leader froze (lease_ttl {TTL} s)")
            assert leadership.epoch > frozen_epoch and leadership.valid()
            assert TTL / 2 < takeover_s < TTL + 1.5
            await leadership.resign()

        _run(etcd, cluster, scenario, 1, role(credentials, "scheduler"))
        woke = json.loads(_read_line(child, 10))
        assert woke == {"valid": False, "lost": woke["lost"], "lost_soon": True}
        assert child.wait(5) == 0
    finally:
        if child.poll() is None:
            os.kill(child.pid, signal.SIGCONT)
            child.kill()
        child.wait()


def test_watch_leader_yields_the_current_leader_then_each_change(secure_etcd, cluster, credentials):
    async def scenario(watcher: Coordinator, candidate: Coordinator) -> None:
        seen: asyncio.Queue[LeaderInfo | None] = asyncio.Queue()

        async def watch() -> None:
            async for leader in watcher.watch_leader():
                await seen.put(leader)

        asyncio.create_task(watch())
        assert await asyncio.wait_for(seen.get(), 5) is None
        first = await candidate.campaign("one", {"pid": 1})
        assert await asyncio.wait_for(seen.get(), 5) == LeaderInfo(first.epoch, "one", {"pid": 1})
        await first.resign()
        assert await asyncio.wait_for(seen.get(), 5) is None
        second = await candidate.campaign("two", {})
        assert (await asyncio.wait_for(seen.get(), 5)).epoch == second.epoch > first.epoch
        await second.resign()

    _run(secure_etcd, cluster, scenario, 2, role(credentials, "scheduler"))


def test_members_register_update_leave_and_expire_with_their_lease(
    secure_etcd, cluster, credentials
):
    async def scenario(coord: Coordinator, other: Coordinator) -> None:
        w1 = await coord.register("worker", "w1", {"address": "h1:1"})
        await other.register("worker", "w2", {"address": "h2:2"})
        await coord.register("frontend", "f1", {})
        assert await coord.members("worker") == [
            {"address": "h1:1", "member_id": "w1"},
            {"address": "h2:2", "member_id": "w2"},
        ]
        await w1.update({"address": "h1:9"})
        assert (await other.members("worker"))[0] == {"address": "h1:9", "member_id": "w1"}
        await w1.leave()
        assert [m["member_id"] for m in await coord.members("worker")] == ["w2"]

        # the lease goes (as if the member was cut off from etcd): it registers again
        key = f"/{cluster}/members/frontend/f1".encode()
        await coord.client.revoke_lease((await coord.client.get(key)).lease)
        await _eventually(lambda: coord.members("frontend"), 2 * TTL)
        assert await coord.members("frontend") == [{"member_id": "f1"}]

        await other.close()  # no leave(): w2's key goes when its lease expires
        started = time.monotonic()
        await _eventually(lambda: _none_left(coord), 2 * TTL + 1)
        assert time.monotonic() - started > TTL / 4

    _run(secure_etcd, cluster, scenario, 2, role(credentials, "scheduler"))


async def _none_left(coord: Coordinator) -> bool:
    return await coord.members("worker") == []


@pytest.mark.parametrize("down_for", [0.0, 1.5 * TTL], ids=["within-ttl", "past-ttl"])
def test_etcd_restart_under_a_leader_leaves_a_consistent_state(
    secure_etcd, cluster, credentials, down_for
):
    etcd = secure_etcd

    async def scenario(coord: Coordinator, watcher: Coordinator) -> None:
        latest: list[LeaderInfo | None] = []

        async def watch() -> None:
            async for leader in watcher.watch_leader():
                latest.append(leader)

        asyncio.create_task(watch())
        leading = await coord.campaign("a", {})
        member = await coord.register("worker", "w", {})
        await _eventually(lambda: latest and latest[-1] is not None)

        await asyncio.to_thread(etcd.restart, down_for=down_for)
        await asyncio.sleep(TTL / 2)
        assert leading.valid() == (not leading.lost.is_set())
        if down_for > TTL:
            assert leading.lost.is_set()
        if leading.lost.is_set():
            started = time.monotonic()
            leading = await asyncio.wait_for(coord.campaign("a", {}), 3 * TTL)
            print(f"leader again {time.monotonic() - started:.2f} s after etcd was back")
        assert leading.valid()
        await _eventually(lambda: latest[-1] == LeaderInfo(leading.epoch, "a", {}))
        assert await coord.leader() == latest[-1]
        assert [m["member_id"] for m in await watcher.members("worker")] == ["w"]
        await member.leave()
        await leading.resign()

    _run(etcd, cluster, scenario, 2, role(credentials, "scheduler"))


def test_leader_watcher_thread_reports_changes_to_threaded_code(secure_etcd, cluster, credentials):
    """As a worker follows the leader: with the worker's certificate, which may read."""
    changes: list[LeaderInfo | None] = []
    changed = threading.Event()

    def on_change(leader: LeaderInfo | None) -> None:
        changes.append(leader)
        changed.set()

    worker = role(credentials, "worker")
    thread = LeaderWatcherThread(secure_etcd.endpoint, on_change, cluster, credentials=worker)
    thread.start()
    try:
        assert changed.wait(5) and changes == [None]
        assert thread.wait_for_leader(0.1) is None

        async def scenario(coord: Coordinator) -> None:
            leading = await coord.campaign("s1", {"worker_address": "h:50052"})
            seen = await asyncio.to_thread(thread.wait_for_leader, 5)
            assert seen == LeaderInfo(leading.epoch, "s1", {"worker_address": "h:50052"})
            assert thread.current() == seen
            await leading.resign()

        _run(secure_etcd, cluster, scenario, 1, role(credentials, "scheduler"))
        deadline = time.monotonic() + 5
        while thread.current() is not None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert changes[-1] is None and len(changes) == 3
    finally:
        thread.stop()
    assert not thread.is_alive()


def test_etcd_does_not_outlive_its_killed_parent(tmp_path):
    parent = subprocess.Popen(
        [sys.executable, "-m", "common.etcd_server", "--port", "0", "--data-dir", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        etcd_pid = int(_read_line(parent, 15).split(", pid ")[1].split(",")[0])
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while _running(etcd_pid):
        assert time.monotonic() < deadline, "etcd survived its parent"
        time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"
