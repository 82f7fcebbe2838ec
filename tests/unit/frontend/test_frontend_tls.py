"""A front-end's link to the leader over mutual TLS: a SchedulerLink (frontend_svc) dials a real
FrontendLinkService whose port serves the cluster's mutual TLS with the scheduler's certificate
(as `splitserve scheduler --credentials` does), in front of a ServingEngine with a fake worker.
With the front-end's credentials it connects and tokens stream; without a certificate, with one
of another CA, with another role's, or in plaintext it gets nothing. A link without credentials
refuses to dial a leader beyond loopback. The front-end also serves its client API over TLS."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from common.credentials import Credentials
from common.link_auth import RoleInterceptor
from common.pb import frontend_link_pb2_grpc
from frontend_svc.leader_finder import FixedLeader
from frontend_svc.link_tls import LinkTls, PlaintextRefused
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink
from scheduler_svc.core import FinishReason
from scheduler_svc.engine.priority_change import PriorityChangeError
from scheduler_svc.ha.cluster_view import SchedulerRole
from scheduler_svc.links.frontend_link import FrontendLinkService
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
    """For the client API's own TLS (any CA the operator chooses)."""
    directory = tmp_path_factory.mktemp("certs")
    ca = CertAuthority(directory)
    return {
        "ca": ca.cert_file,
        "server": ca.issue("localhost", server=True),  # SANs: localhost, 127.0.0.1
        "client": ca.issue("client-1", server=False),
    }


def make_link(port: int, tls: LinkTls) -> SchedulerLink:
    return SchedulerLink(
        FrontendIdentity("fe-tls", "localhost", 1),
        "fake",
        FixedLeader(f"127.0.0.1:{port}"),
        leader_wait_timeout=10.0,
        tls=tls,
    )


class TlsLeader:
    """The scheduler's internal port as `splitserve scheduler --credentials DIR` serves it."""

    def __init__(self, credentials: Credentials) -> None:
        self.engine = make_engine()
        self.session = self.engine.attach(registration("w0"), FakeWorker())
        self.credentials = credentials
        self.server: grpc.aio.Server | None = None
        self.port = 0
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(run_session(self.engine, self.session))
        self.server = grpc.aio.server(interceptors=[RoleInterceptor()])
        frontend_link_pb2_grpc.add_FrontendLinkServicer_to_server(
            FrontendLinkService(self.engine, SchedulerRole(), 512), self.server
        )
        self.port = self.server.add_secure_port(
            "127.0.0.1:0", self.credentials.server_credentials()
        )
        await self.server.start()

    async def stop(self) -> None:
        assert self.server is not None and self.task is not None
        await self.server.stop(0)
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def role(cluster_credentials, name: str, cluster: str = "") -> Credentials:
    base = cluster_credentials.parent / "rogue" if cluster == "rogue" else cluster_credentials
    return Credentials.load(base / name)


@run_async
async def test_a_frontend_with_its_credentials_reaches_the_leader_and_tokens_stream(
    cluster_credentials,
):
    leader = TlsLeader(role(cluster_credentials, "scheduler"))
    await leader.start()
    # dialled as 127.0.0.1, verified as splitserve-scheduler: whatever address etcd names
    link = make_link(leader.port, LinkTls(role(cluster_credentials, "frontend")))
    try:
        await link.start()
        await asyncio.wait_for(link.connected.wait(), 10)
        state = make_state("r0", [5, 6, 7], 8)
        link.submit(state)
        tokens, deltas = await asyncio.wait_for(drain(state), 10)
        assert tokens == reference([5, 6, 7], 8)
        assert deltas[-1].finish_reason == FinishReason.LENGTH
        # SetPriority dials its own channel: over mutual TLS too (the request has finished:
        # NOT_FOUND from the leader, not UNAVAILABLE from a refused handshake)
        with pytest.raises(PriorityChangeError) as refused:
            await link.change_priority("r0", 3)
        assert refused.value.code == "NOT_FOUND", str(refused.value)
    finally:
        await link.stop()
        await leader.stop()


@run_async
async def test_the_leader_refuses_a_frontend_without_a_frontend_certificate_of_its_ca(
    cluster_credentials,
):
    leader = TlsLeader(role(cluster_credentials, "scheduler"))
    await leader.start()
    links = {
        "another CA's front-end": make_link(
            leader.port, LinkTls(role(cluster_credentials, "frontend", "rogue"))
        ),
        "a worker's certificate": make_link(
            leader.port, LinkTls(role(cluster_credentials, "worker"))
        ),
        "plaintext": make_link(leader.port, LinkTls()),
    }
    try:
        for link in links.values():
            await link.start()
        await asyncio.sleep(REFUSED_WITHIN_S)
        connected = [why for why, link in links.items() if link.connected.is_set()]
        assert connected == []
        assert leader.engine.frontends == {}
    finally:
        for link in links.values():
            await link.stop()
        await leader.stop()


@run_async
async def test_a_frontend_trusts_only_the_scheduler_certificate_of_its_cluster(
    cluster_credentials,
):
    """A rogue leader (etcd or a flag pointing elsewhere) with a certificate of another
    cluster, or with a worker's certificate of this one, gets no hello: the handshake fails
    before the front-end sends its requests."""
    rogues = [
        TlsLeader(role(cluster_credentials, "scheduler", "rogue")),
        TlsLeader(role(cluster_credentials, "worker")),
    ]
    links = []
    try:
        for rogue in rogues:
            await rogue.start()
            link = make_link(rogue.port, LinkTls(role(cluster_credentials, "frontend")))
            link.submit(make_state(f"secret-{len(links)}", [5, 6, 7], 4))
            await link.start()
            links.append(link)
        await asyncio.sleep(REFUSED_WITHIN_S)
        assert [link.connected.is_set() for link in links] == [False, False]
        assert [rogue.engine.frontends for rogue in rogues] == [{}, {}]
        assert [rogue.engine.requests for rogue in rogues] == [{}, {}]
    finally:
        for link in links:
            await link.stop()
        for rogue in rogues:
            await rogue.stop()


@run_async
async def test_without_credentials_a_link_dials_loopback_only():
    assert not LinkTls().on
    for address in ("127.0.0.1:1", "localhost:1"):  # a channel; nothing is dialled yet
        await LinkTls().channel(address).close()
    for address in ("10.0.0.7:50052", "scheduler-a:50052", "[2001:db8::1]:50052"):
        with pytest.raises(PlaintextRefused, match="--credentials"):
            LinkTls().channel(address)


@run_async
async def test_the_frontend_serves_its_client_api_over_mutual_tls(certs):
    import ssl

    import httpx
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from splitserve.frontend import FrontendConfig, FrontendServer
    from tests.e2e.procs import free_port

    cert, key = certs["server"]
    client_cert, client_key = certs["client"]  # any certificate of the CA will do
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
