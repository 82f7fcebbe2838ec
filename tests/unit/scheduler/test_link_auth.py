"""The scheduler's internal port as `splitserve scheduler --credentials DIR` serves it (a real
SchedulerServer in this process): mutual TLS under the cluster's CA, the WorkerLink only for a
worker's certificate, the FrontendLink only for a front-end's and only where front-ends run
apart; nothing for a peer without a certificate, with another CA's, or in plaintext. Without
credentials the scheduler refuses to listen beyond loopback. The credentials themselves: one
CA, a certificate per role, private files."""

from __future__ import annotations

import asyncio
import functools
import stat

import grpc
import pytest

from common.credentials import (
    ROLES,
    Credentials,
    CredentialsError,
    certificate_role,
    create_cluster,
)
from common.link_auth import is_loopback, scheduler_channel
from common.pb import frontend_link_pb2 as fpb
from common.pb import frontend_link_pb2_grpc, worker_link_pb2_grpc
from common.pb import worker_link_pb2 as wpb
from scheduler_svc.config import SchedulerServiceConfig
from splitserve.scheduler_process import SchedulerServer


def run_async(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return wrapper


def creds(cluster_credentials, role: str, rogue: bool = False) -> Credentials:
    base = cluster_credentials.parent / "rogue" if rogue else cluster_credentials
    return Credentials.load(base / role)


def scheduler_config(cluster_credentials, client_api: bool = False) -> SchedulerServiceConfig:
    return SchedulerServiceConfig(
        host="127.0.0.1",
        port=0,
        worker_port=0,
        http_port=0,
        client_api=client_api,
        credentials=str(cluster_credentials / "scheduler"),
        log_json=False,
    )


def channel(port: int, credentials: Credentials | None) -> grpc.aio.Channel:
    """As a worker or front-end dials (plaintext to loopback without credentials)."""
    return scheduler_channel(f"127.0.0.1:{port}", credentials, aio=True)


def register_message(model: str) -> wpb.WorkerMessage:
    return wpb.WorkerMessage(
        register=wpb.Register(
            worker_id="w-test",
            model=model,
            block_size=16,
            num_device_blocks=64,
            max_model_len=512,
            vocab_size=49152,
        )
    )


async def try_worker_link(port: int, credentials: Credentials | None, model: str):
    """The first answer to a Register on the WorkerLink, or the status code that ended it."""
    async with channel(port, credentials) as ch:
        call = worker_link_pb2_grpc.WorkerLinkStub(ch).Connect()
        try:
            await call.write(register_message(model))
            reply = await asyncio.wait_for(call.read(), 10)
            return reply.WhichOneof("msg") if reply is not grpc.aio.EOF else "eof"
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            call.cancel()


async def try_frontend_link(port: int, credentials: Credentials | None):
    async with channel(port, credentials) as ch:
        call = frontend_link_pb2_grpc.FrontendLinkStub(ch).Connect()
        hello = fpb.FrontendHello(frontend_id="fe-test")
        try:
            await call.write(fpb.FrontendMessage(hello=hello))
            reply = await asyncio.wait_for(call.read(), 10)
            return reply.WhichOneof("msg") if reply is not grpc.aio.EOF else "eof"
        except grpc.aio.AioRpcError as exc:
            return exc.code()
        finally:
            call.cancel()


@run_async
async def test_each_link_opens_only_for_its_role_certificate(cluster_credentials):
    server = SchedulerServer(scheduler_config(cluster_credentials))
    await server.start()
    port, model = server.worker_port, server.engine.model_name
    try:
        worker = creds(cluster_credentials, "worker")
        frontend = creds(cluster_credentials, "frontend")
        scheduler = creds(cluster_credentials, "scheduler")
        assert await try_worker_link(port, worker, model) == "register_ack"
        assert await try_frontend_link(port, frontend) == "hello_ack"
        for other in (frontend, scheduler):
            assert await try_worker_link(port, other, model) == grpc.StatusCode.PERMISSION_DENIED
        for other in (worker, scheduler):
            assert await try_frontend_link(port, other) == grpc.StatusCode.PERMISSION_DENIED
        outsiders = [None, creds(cluster_credentials, "worker", rogue=True)]
        for outsider in outsiders:  # no handshake: nothing is read, not even the method
            assert await try_worker_link(port, outsider, model) == grpc.StatusCode.UNAVAILABLE
            assert await try_frontend_link(port, outsider) == grpc.StatusCode.UNAVAILABLE
        assert sorted(server.engine.frontends) == []  # the test front-end has gone again
    finally:
        await server.stop(grace=0)


@run_async
async def test_no_frontend_link_where_the_scheduler_serves_its_clients_itself(
    cluster_credentials,
):
    server = SchedulerServer(scheduler_config(cluster_credentials, client_api=True))
    await server.start()
    try:
        frontend = creds(cluster_credentials, "frontend")
        assert await try_frontend_link(server.worker_port, frontend) == (
            grpc.StatusCode.UNIMPLEMENTED
        )
    finally:
        await server.stop(grace=0)


def test_without_credentials_the_scheduler_listens_on_loopback_only(capsys):
    cfg = SchedulerServiceConfig(host="0.0.0.0", port=0, worker_port=0, http_port=0)
    with pytest.raises(SystemExit) as refused:
        SchedulerServer(cfg)
    assert "--credentials" in str(refused.value) and "127.0.0.1" in str(refused.value)


def test_a_process_refuses_another_roles_credentials(cluster_credentials):
    cfg = SchedulerServiceConfig(
        host="127.0.0.1", port=0, worker_port=0, http_port=0,
        credentials=str(cluster_credentials / "worker"),
    )  # fmt: skip
    with pytest.raises(SystemExit, match="a worker's certificate; this process is a scheduler"):
        SchedulerServer(cfg)


def test_loopback_hosts():
    assert all(map(is_loopback, ("127.0.0.1", "127.3.4.5", "localhost", "::1", "[::1]")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.1.2.3", "scheduler-a", "")))


def test_a_cluster_has_one_ca_and_a_private_certificate_per_role(tmp_path):
    root = create_cluster(tmp_path / "creds")
    ca = (root / "ca" / "ca.crt").read_bytes()
    for role in ROLES:
        loaded = Credentials.load(root / role, role)
        assert loaded.role == role == certificate_role(loaded.cert)
        assert loaded.ca == ca
        assert stat.S_IMODE((root / role).stat().st_mode) == 0o700
        for name in ("ca.crt", "tls.crt", "tls.key"):
            assert stat.S_IMODE((root / role / name).stat().st_mode) == 0o600
    assert stat.S_IMODE((root / "ca" / "ca.key").stat().st_mode) == 0o600
    before = {role: (root / role / "tls.key").read_bytes() for role in ROLES}
    create_cluster(root)  # a second start keeps them
    assert before == {role: (root / role / "tls.key").read_bytes() for role in ROLES}
    (root / "worker" / "tls.crt").unlink()  # a broken role is issued again, under the same CA
    create_cluster(root)
    assert Credentials.load(root / "worker", "worker").ca == ca


def test_missing_files_are_named(tmp_path):
    (tmp_path / "ca.crt").write_text("")
    with pytest.raises(CredentialsError, match="tls.crt"):
        Credentials.load(tmp_path)


def test_a_worker_or_front_end_without_credentials_reaches_loopback_only(cluster_credentials):
    from splitserve.frontend import FrontendConfig
    from splitserve.frontend import load_credentials as frontend_credentials
    from worker_svc.link import WorkerLinkConfig
    from worker_svc.main import load_credentials as worker_credentials

    for far in ("10.0.0.7:50052", "scheduler-a:50052"):
        for cfg in (WorkerLinkConfig(scheduler=far), WorkerLinkConfig(etcd=far)):
            with pytest.raises(SystemExit, match="--credentials"):
                worker_credentials(cfg)
        for cfg in (FrontendConfig(scheduler=far), FrontendConfig(etcd=far)):
            with pytest.raises(SystemExit, match="--credentials"):
                frontend_credentials(cfg)
    assert worker_credentials(WorkerLinkConfig(scheduler="127.0.0.1:50052")) is None
    assert frontend_credentials(FrontendConfig(etcd="localhost:2379")) is None
    worker = WorkerLinkConfig(
        scheduler="10.0.0.7:50052", credentials=str(cluster_credentials / "worker")
    )
    assert worker_credentials(worker).role == "worker"
