"""The container probe (docker/healthcheck.py, `splitserve-health`) with a role's credentials:
it reads the leader key from etcd with auth on and asks that scheduler over mutual TLS."""

from __future__ import annotations

import asyncio
import importlib.util
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common.coordination import Coordinator
from common.credentials import Credentials, create_cluster
from tests.unit.common import test_coordination as coordination_tests

ROOT = Path(__file__).resolve().parents[3]
WORKER_LINK = "splitserve.v1.WorkerLink"

credentials = coordination_tests.credentials
secure_etcd = coordination_tests.secure_etcd
role = coordination_tests.role


def probe(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location(
        "splitserve_health", ROOT / "docker/healthcheck.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main([*argv, "--timeout", "2"])


def serve_health(server_credentials: Credentials) -> tuple[grpc.Server, str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(WORKER_LINK, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_secure_port("127.0.0.1:0", server_credentials.server_credentials())
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def scheduler(credentials):
    server, address = serve_health(role(credentials, "scheduler"))
    yield address
    server.stop(0)


def test_a_worker_probe_finds_the_leader_in_etcd_and_asks_it_over_mutual_tls(
    secure_etcd, credentials, scheduler, tmp_path
):
    async def lead_and_probe() -> list[int]:
        coord = Coordinator(
            secure_etcd.endpoint, credentials=role(credentials, "scheduler"), lease_ttl=5.0
        )
        await coord.connect()
        leadership = await coord.campaign("s1", {"worker_address": scheduler})
        try:
            leader = ["--etcd-leader", secure_etcd.endpoint, "--service", WORKER_LINK]
            stranger = create_cluster(tmp_path) / "worker"
            return [
                await asyncio.to_thread(probe, [*leader, "--credentials", str(credentials / r)])
                for r in ("worker", "frontend")
            ] + [
                await asyncio.to_thread(probe, leader),  # plaintext to etcd's TLS port
                await asyncio.to_thread(probe, [*leader, "--credentials", str(stranger)]),
            ]
        finally:
            await leadership.resign()
            await coord.close()

    assert asyncio.run(asyncio.wait_for(lead_and_probe(), 30)) == [0, 0, 1, 1]


def test_a_grpc_probe_trusts_only_the_scheduler_certificate(credentials, scheduler):
    worker = str(credentials / "worker")
    assert probe(["--target", scheduler, "--credentials", worker]) == 0
    assert probe(["--target", scheduler]) == 1  # plaintext to a TLS port
    # a certificate of the cluster's CA that does not name the scheduler
    impostor, address = serve_health(role(credentials, "frontend"))
    try:
        assert probe(["--target", address, "--credentials", worker]) == 1
    finally:
        impostor.stop(0)


def test_an_http_probe_reads_etcd_health_on_loopback(secure_etcd):
    assert probe(["--http", secure_etcd.health_url, "--expect", '"health":"true"']) == 0
