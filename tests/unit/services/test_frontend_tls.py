"""A front-end's link to the leader over TLS: a SchedulerLink (frontend_svc) dials a real
FrontendLinkService whose port serves mutual TLS (common/tls.add_port, as the scheduler's
`--worker-tls-*` flags set it up), in front of a ServingEngine with a fake worker. With the CA,
its own certificate and the server name it connects and tokens stream; without a client
certificate, with one of another CA, or in plaintext the port refuses it. The front-end's
`--scheduler-tls*` and `--tls-*` flags exist and reach the link."""

from __future__ import annotations

import argparse
import asyncio
import functools

import grpc
import pytest

from common.pb import frontend_link_pb2_grpc
from common.settings import add_dataclass_args, dataclass_from_args
from common.tls import add_port
from frontend_svc.leader_finder import FixedLeader
from frontend_svc.link_tls import LinkTls
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink
from scheduler_svc.cluster_view import SchedulerRole
from scheduler_svc.core import FinishReason, RequestRejected
from scheduler_svc.frontend_link_service import FrontendLinkService
from scheduler_svc.policy_control import PriorityChangeError
from tests.e2e.certs import CertAuthority
from tests.engine_fakes import (
    FakeWorker,
    drain,
    make_engine,
    make_state,
    reference,
    registration,
    run_session,
)

REFUSED_WITHIN_S = 1.5  # a handshake on loopback takes milliseconds


def run_async(test):
    @functools.wraps(test)
    def wrapper(*args, **kwargs) -> None:
        asyncio.run(test(*args, **kwargs))

    return wrapper


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("certs")
    ca = CertAuthority(directory)
    rogue = CertAuthority(directory, "rogue CA")
    return {
        "ca": ca.cert_file,
        "server": ca.issue("localhost", server=True),  # SANs: localhost, 127.0.0.1
        "frontend": ca.issue("frontend-1", server=False),
        "rogue": rogue.issue("rogue-frontend", server=False),
    }


def make_link(port: int, tls: LinkTls) -> SchedulerLink:
    return SchedulerLink(
        FrontendIdentity("fe-tls", "localhost", 1),
        "fake",
        FixedLeader(f"127.0.0.1:{port}"),
        finish_reasons={r.value: r for r in FinishReason},
        rejected_error=RequestRejected,
        priority_error=PriorityChangeError,
        leader_wait_timeout=10.0,
        tls=tls,
    )


class TlsLeader:
    """The scheduler's internal port as `--worker-tls-cert-file/-key-file/-ca-file` serve it."""

    def __init__(self, certs: dict) -> None:
        self.engine = make_engine()
        self.session = self.engine.attach(registration("w0"), FakeWorker())
        self.certs = certs
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(run_session(self.engine, self.session))
        self.server = grpc.aio.server()
        frontend_link_pb2_grpc.add_FrontendLinkServicer_to_server(
            FrontendLinkService(self.engine, SchedulerRole(), 512), self.server
        )
        cert, key = self.certs["server"]
        self.port = add_port(self.server, "127.0.0.1:0", cert, key, self.certs["ca"])
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None and self.task is not None
        await self.server.stop(0)
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def mutual(certs: dict, **changes) -> LinkTls:
    cert, key = certs["frontend"]
    fields = {"ca_file": certs["ca"], "cert_file": cert, "key_file": key}
    return LinkTls(**{**fields, "server_name": "localhost", **changes})


@run_async
async def test_a_frontend_with_its_certificate_reaches_a_mutual_tls_leader_and_tokens_stream(
    certs,
):
    leader = TlsLeader(certs)
    await leader.start()
    # dialled as 127.0.0.1, verified as localhost: the certificate's name, as in a cluster where
    # the leader's per-pod name differs from the name in the certificate
    link = make_link(leader.port, mutual(certs))
    try:
        await link.start()
        await asyncio.wait_for(link.connected.wait(), 10)
        state = make_state("r0", [5, 6, 7], 8)
        link.submit(state)
        tokens, deltas = await asyncio.wait_for(drain(state), 10)
        assert tokens == reference([5, 6, 7], 8)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        # SetPriority dials its own channel: over TLS too (the request has finished: NOT_FOUND
        # from the leader, not UNAVAILABLE from a refused handshake)
        with pytest.raises(PriorityChangeError) as refused:
            await link.change_priority("r0", 3)
        assert refused.value.code == "NOT_FOUND", str(refused.value)
    finally:
        await link.stop()
        await leader.stop()


@run_async
async def test_the_mutual_tls_port_refuses_a_frontend_without_a_certificate_of_its_ca(certs):
    leader = TlsLeader(certs)
    await leader.start()
    rogue_cert, rogue_key = certs["rogue"]
    links = {
        "no client certificate": make_link(leader.port, LinkTls(ca_file=certs["ca"])),
        "another CA's certificate": make_link(
            leader.port, mutual(certs, cert_file=rogue_cert, key_file=rogue_key)
        ),
        "plaintext": make_link(leader.port, LinkTls()),
        "a name not in the certificate": make_link(
            leader.port, mutual(certs, server_name="splitserve-scheduler.elsewhere.svc")
        ),
    }
    try:
        for link in links.values():
            await link.start()
        await asyncio.sleep(REFUSED_WITHIN_S)
        connected = [why for why, link in links.items() if link.connected.is_set()]
        assert connected == []
    finally:
        for link in links.values():
            await link.stop()
        await leader.stop()


def test_link_tls_settings_fail_at_startup_not_on_every_reconnect(certs, tmp_path):
    cert, key = certs["frontend"]
    assert not LinkTls().on
    assert LinkTls(enabled=True).on and LinkTls(ca_file=certs["ca"]).on
    LinkTls().check()
    mutual(certs).check()
    with pytest.raises(ValueError, match="both"):
        LinkTls(ca_file=certs["ca"], cert_file=cert).check()
    with pytest.raises(ValueError, match="needs TLS"):
        LinkTls(server_name="localhost").check()
    with pytest.raises(OSError):
        LinkTls(ca_file=str(tmp_path / "missing.crt")).check()


def test_frontend_flags_and_environment_reach_the_link(monkeypatch):
    from splitserve.frontend import FrontendConfig

    parser = argparse.ArgumentParser()
    monkeypatch.setenv("SPLITSERVE_SCHEDULER_TLS_SERVER_NAME", "splitserve-scheduler.ns.svc")
    add_dataclass_args(parser, FrontendConfig)
    args = parser.parse_args(
        [
            "--scheduler-tls-ca-file",
            "/tls/ca.crt",
            "--scheduler-tls-cert-file",
            "/tls/tls.crt",
            "--scheduler-tls-key-file",
            "/tls/tls.key",
            "--tls-cert-file",
            "/srv/client-api.crt",
            "--tls-key-file",
            "/srv/client-api.key",
            "--tls-client-ca-file",
            "/srv/clients-ca.crt",
        ]
    )
    cfg = dataclass_from_args(FrontendConfig, args)
    assert cfg.scheduler_tls is False  # implied by the CA file, as the worker's --tls is
    assert (cfg.scheduler_tls_ca_file, cfg.scheduler_tls_cert_file, cfg.scheduler_tls_key_file) == (
        "/tls/ca.crt",
        "/tls/tls.crt",
        "/tls/tls.key",
    )
    assert cfg.scheduler_tls_server_name == "splitserve-scheduler.ns.svc"
    assert (cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file) == (
        "/srv/client-api.crt",
        "/srv/client-api.key",
        "/srv/clients-ca.crt",
    )


@run_async
async def test_the_frontend_serves_its_client_api_over_mutual_tls(certs):
    import ssl

    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.frontend import FrontendConfig, FrontendServer
    from tests.e2e.procs import free_port

    cert, key = certs["server"]
    client_cert, client_key = certs["frontend"]  # any certificate of the CA will do
    cfg = FrontendConfig(
        host="127.0.0.1",
        port=0,
        http_port=free_port(),
        scheduler=f"127.0.0.1:{free_port()}",  # no leader: the client API serves all the same
        tls_cert_file=cert,
        tls_key_file=key,
        tls_client_ca_file=certs["ca"],
        log_json=False,
    )
    server = FrontendServer(cfg)
    await server.start()
    target = f"127.0.0.1:{server.port}"
    request = health_pb2.HealthCheckRequest(service="")
    try:
        creds = grpc.ssl_channel_credentials(
            open(certs["ca"], "rb").read(),
            open(client_key, "rb").read(),
            open(client_cert, "rb").read(),
        )
        async with grpc.aio.secure_channel(target, creds) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(request, timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for channel in (
            grpc.aio.insecure_channel(target),
            grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(creds_ca(certs))),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await health_pb2_grpc.HealthStub(channel).Check(request, timeout=2)
        context = ssl.create_default_context(cafile=certs["ca"])
        context.load_cert_chain(client_cert, client_key)
        async with httpx.AsyncClient(verify=context) as http:
            answer = await http.get(f"https://127.0.0.1:{cfg.http_port}/health", timeout=5)
        assert answer.status_code == 200
        async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=certs["ca"])) as http:
            with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake fails
                await http.get(f"https://127.0.0.1:{cfg.http_port}/health", timeout=5)
    finally:
        await server.stop()


def creds_ca(certs) -> bytes:
    with open(certs["ca"], "rb") as f:
        return f.read()
