"""No key of etcd is writable without the scheduler's certificate (common/etcd_auth.py,
common/etcd_server.py): the attack where any local process replaced /splitserve/leader with its
own server, and front-ends and workers followed it, is closed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable

import aetcd
import grpc
import pytest
from aetcd import rpc

from common.coordination import Coordinator, LeaderInfo
from common.credentials import Credentials, create_cluster
from common.etcd_auth import ensure_auth_blocking
from common.etcd_auth import main as etcd_auth_main
from common.etcd_client import EtcdClient
from common.etcd_server import EtcdServer
from common.etcd_server import main as etcd_server_main
from tests.unit.common import test_coordination as coordination_tests

# the same fixtures as the coordination tests: a cluster's credentials, etcd with auth on
credentials = coordination_tests.credentials
secure_etcd = coordination_tests.secure_etcd
role = coordination_tests.role

CLUSTER = "splitserve"
LEADER_KEY = b"/splitserve/leader"
TTL = 2.0


def client(etcd: EtcdServer, credentials: Credentials | None) -> EtcdClient:
    host, _, port = etcd.endpoint.rpartition(":")
    return EtcdClient(host, int(port), credentials, timeout=2.0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


async def _refused(attempt: Awaitable[object]) -> bool:
    try:
        await attempt
    except (aetcd.ClientError, grpc.RpcError):
        return True
    return False


@pytest.fixture
def leader(secure_etcd, credentials):
    """The real leader: a scheduler holding the leader key under its lease, for the test."""
    holder: dict = {}

    async def campaign() -> LeaderInfo:
        coord = Coordinator(
            secure_etcd.endpoint, CLUSTER, TTL, credentials=role(credentials, "scheduler")
        )
        await coord.connect()
        holder["coord"] = coord
        holder["leadership"] = await coord.campaign("real", {"worker_address": "real:50052"})
        found = await coord.leader()
        assert found is not None
        return found

    return holder, campaign


def test_without_a_certificate_nothing_is_read_or_written(secure_etcd, credentials):
    ca = role(credentials, "worker").ca

    async def scenario() -> None:
        plain = client(secure_etcd, None)  # plaintext to a TLS port
        assert await _refused(plain.get(LEADER_KEY))
        assert await _refused(plain.put(LEADER_KEY, b"rogue"))
        await plain.close()
        # TLS that trusts etcd but shows no certificate: the handshake is refused
        channel = grpc.aio.secure_channel(
            secure_etcd.endpoint,
            grpc.ssl_channel_credentials(root_certificates=ca),
            options=[("grpc.ssl_target_name_override", "splitserve-etcd")],
        )
        kv = rpc.KVStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            await kv.Range(rpc.RangeRequest(key=LEADER_KEY), timeout=2.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        await channel.close()

    run(scenario)


def test_a_certificate_of_another_ca_is_refused(secure_etcd, credentials, tmp_path):
    ours = role(credentials, "scheduler")
    theirs = Credentials.load(create_cluster(tmp_path) / "scheduler", "scheduler")
    # trusts our etcd, shows a scheduler's certificate that our CA never signed
    forged = dataclasses.replace(ours, cert=theirs.cert, key=theirs.key)

    async def scenario() -> None:
        rogue = client(secure_etcd, forged)
        assert await _refused(rogue.get(LEADER_KEY))
        assert await _refused(rogue.put(LEADER_KEY, b"rogue"))
        await rogue.close()

    run(scenario)


@pytest.mark.parametrize("follower", ["worker", "frontend"])
def test_a_follower_reads_the_leader_but_cannot_replace_or_depose_it(
    secure_etcd, credentials, leader, follower
):
    holder, campaign = leader
    creds = role(credentials, follower)

    async def scenario() -> None:
        real = await campaign()
        coord = Coordinator(secure_etcd.endpoint, CLUSTER, TTL, credentials=creds)
        await coord.connect()
        try:
            assert await coord.leader() == real
            raw = coord.client
            rogue = json.dumps({"member_id": "rogue", "info": {"worker_address": "evil:1"}})
            assert await _refused(raw.delete(LEADER_KEY))
            assert await _refused(raw.put(LEADER_KEY, rogue.encode()))
            assert await _refused(raw.revoke_lease(real.lease_id))
            assert await _refused(raw.put(b"/splitserve/members/scheduler/rogue", b"{}"))
            assert await _refused(raw.get(b"/splitserve/state"))  # only the leader key
            with pytest.raises(PermissionError, match="refused"):
                await coord.campaign("rogue", {"worker_address": "evil:1"})
            await coord.depose(real)  # a revoke etcd refuses: the leader stays
            assert await coord.leader() == real
            assert holder["leadership"].valid()
        finally:
            await coord.close()
            await holder["leadership"].resign()
            await holder["coord"].close()

    run(scenario)


def test_the_etcd_certificate_names_no_user_and_reads_nothing(secure_etcd, credentials):
    async def scenario() -> None:
        coord = Coordinator(secure_etcd.endpoint, CLUSTER, credentials=role(credentials, "etcd"))
        with pytest.raises(PermissionError, match="the etcd's certificate"):
            await coord.connect()
        await coord.close()

    run(scenario)


def test_the_scheduler_campaigns_registers_and_deposes(secure_etcd, credentials, leader):
    holder, campaign = leader

    async def scenario() -> None:
        real = await campaign()
        standby = Coordinator(
            secure_etcd.endpoint, CLUSTER, TTL, credentials=role(credentials, "scheduler")
        )
        await standby.connect()
        try:
            member = await standby.register("scheduler", "standby", {})
            await standby.put_json("state", {"epoch": real.epoch})
            assert await standby.get_json("state") == {"epoch": real.epoch}
            await standby.depose(real)
            await asyncio.wait_for(holder["leadership"].lost.wait(), TTL)
            leadership = await asyncio.wait_for(standby.campaign("standby", {}), 2 * TTL)
            assert leadership.epoch > real.epoch
            await leadership.resign()
            await member.leave()
        finally:
            await standby.close()
            await holder["coord"].close()

    run(scenario)


def test_a_restarted_etcd_keeps_auth_and_the_bootstrap_changes_nothing(credentials, tmp_path):
    server = EtcdServer(
        data_dir=str(tmp_path / "etcd"),
        unsafe_no_fsync=True,
        credentials=role(credentials, "etcd"),
        root_credentials=role(credentials, "root"),
    )
    root = role(credentials, "root")
    server.start()
    try:
        server.root_credentials = None  # no bootstrap on this start: auth lives in the data
        server.restart()
        assert ensure_auth_blocking(server.endpoint, root) == []

        async def scenario() -> None:
            worker = client(server, role(credentials, "worker"))
            assert await _refused(worker.put(LEADER_KEY, b"rogue"))
            assert (await worker.get(LEADER_KEY)) is None
            await worker.close()

        run(scenario)
        argv = ["--endpoint", server.endpoint, "--root-credentials", str(root.directory)]
        assert etcd_auth_main(argv) == 0
    finally:
        server.stop()


def test_the_bootstrap_on_a_fresh_etcd_reports_what_it_made(credentials):
    with EtcdServer(unsafe_no_fsync=True, credentials=role(credentials, "etcd")) as server:
        changes = ensure_auth_blocking(server.endpoint, role(credentials, "root"))
    assert changes[-1] == "auth enabled"
    assert "splitserve-scheduler may read and write [/splitserve/, /splitserve0)" in changes
    assert "splitserve-worker may read /splitserve/leader" in changes


def test_plaintext_is_refused_beyond_loopback_with_a_sentence_naming_the_flag():
    with pytest.raises(ValueError, match="--credentials"):
        Coordinator("etcd.example:2379")
    Coordinator("127.0.0.1:2379")  # loopback: plaintext allowed
    with pytest.raises(SystemExit, match="--credentials"):
        etcd_server_main(["--host", "0.0.0.0", "--port", "0"])


def test_etcd_health_is_served_on_loopback_in_plain_http(secure_etcd):
    import urllib.request

    assert secure_etcd.health_url.startswith("http://127.0.0.1:")
    with urllib.request.urlopen(secure_etcd.health_url, timeout=5) as reply:
        assert b'"health":"true"' in reply.read()
