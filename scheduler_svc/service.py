"""Start the scheduler service: client API, worker links, health and reflection."""

from __future__ import annotations

import asyncio
import signal

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import event_loop
from common.credentials import Credentials, CredentialsError
from common.gc_tuning import tune_gc_for_serving
from common.link_auth import RoleInterceptor, role_credentials, target_host
from common.logging import configure_logging, get_logger
from common.model_source import read_vocab_size, resolve_model
from common.pb import (
    frontend_link_pb2,
    frontend_link_pb2_grpc,
    generation_pb2,
    worker_link_pb2,
    worker_link_pb2_grpc,
)
from common.safe_handlers import add_servicer
from common.tls import add_port
from common.tokenizer import load_tokenizer
from scheduler_svc.auth import ApiKeyInterceptor
from scheduler_svc.cluster_view import SchedulerRole, cluster_status, status_to_json
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.dashboard.history import DashboardHistory
from scheduler_svc.engine import ServingEngine
from scheduler_svc.frontend_link_service import FrontendLinkService
from scheduler_svc.generation_service import GenerationService
from scheduler_svc.http import HttpContext, HttpServer, create_app
from scheduler_svc.intake import Intake
from scheduler_svc.leadership import RoleCollector, lead, member_info
from scheduler_svc.metrics import MetricsObserver, ObserverGroup
from scheduler_svc.remote_request import RemoteRequest
from scheduler_svc.worker_link_service import WorkerLinkService

log = get_logger("splitserve.scheduler")
EXIT_DEPOSED = 3  # this scheduler led and lost its lease (or etcd): start it again as a standby
WORKER_LINK_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a step may carry many long new prompts


def check_config(cfg: SchedulerServiceConfig) -> None:
    """Fail at start (not at the first worker) on a configuration the core refuses."""
    SchedulerConfig(
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        max_num_seqs=cfg.max_num_seqs,
        block_size=16,
        num_blocks=1024,
        watermark=cfg.watermark,
        policy=cfg.scheduling_policy,
        preemption_mode=cfg.preemption_mode,
        enable_chunked_prefill=cfg.enable_chunked_prefill,
        enable_prefix_caching=cfg.enable_prefix_caching,
        max_model_len=cfg.max_model_len,
        long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        speculative=SpeculativeConfig.from_flag(cfg.speculative_config),
    )


def load_credentials(cfg: SchedulerServiceConfig) -> Credentials | None:
    """This scheduler's credentials; without them, every port must stay on loopback."""
    links = {"serve the worker-link port on": cfg.host}
    if cfg.etcd:
        links["lead through the etcd at"] = target_host(cfg.etcd)
    try:
        return role_credentials("scheduler", cfg.credentials, links)
    except CredentialsError as exc:
        raise SystemExit(f"--credentials: {exc}") from exc


class SchedulerServer:
    """The running service: two gRPC servers around one ServingEngine."""

    def __init__(self, cfg: SchedulerServiceConfig) -> None:
        check_config(cfg)
        self.credentials = load_credentials(cfg)
        self.cfg = cfg
        source = resolve_model(cfg.model)
        model_name = cfg.served_model_name or source.name
        self.engine = ServingEngine(cfg, source.name, read_vocab_size(source))
        self.role = SchedulerRole(role="standby" if cfg.etcd else "leader")
        if cfg.scheduler_id:
            self.role.scheduler_id = cfg.scheduler_id
        if cfg.etcd:  # nothing is dispatched before this one leads and has rebuilt
            self.engine.begin_rebuild()
        self.intake: Intake | None = None
        if cfg.client_api:  # the embedded front-end: this process serves the clients too
            aliases = {source.name, model_name, str(cfg.model or "")} - {""}
            tokenizer = load_tokenizer(source)
            self.intake = Intake(tokenizer, model_name, aliases, cfg.max_model_len)
        self.metrics = MetricsObserver(self.engine)
        self.metrics.registry.register(RoleCollector(self.role))
        self.history = DashboardHistory(self.engine)
        self.engine.observer = ObserverGroup(self.metrics, self.history)
        self.health = health.aio.HealthServicer()
        self.client_server: grpc.aio.Server | None = None
        self.port = 0
        if self.intake is not None:
            self.client_server, self.port = self._client_api(cfg, self.intake)
        self.worker_server, self.worker_port = self._internal_port(cfg)
        self.http_ctx = HttpContext(
            self.engine, self.intake, cfg.api_key, self.metrics, self.history, cluster=self.cluster
        )
        self.http: HttpServer | None = None
        if cfg.http_port > 0:
            self.http = HttpServer(
                create_app(self.http_ctx),
                cfg.host,
                cfg.http_port,
                ssl_certfile=cfg.tls_cert_file,
                ssl_keyfile=cfg.tls_key_file,
                ssl_ca_certs=cfg.tls_client_ca_file,
                max_request_bytes=cfg.max_request_bytes,
                header_timeout=cfg.http_header_timeout,
                max_connections=cfg.http_max_connections,
            )

    def _client_api(
        self, cfg: SchedulerServiceConfig, intake: Intake
    ) -> tuple[grpc.aio.Server, int]:
        interceptors = []
        if cfg.api_key:
            observer = self.engine.observer

            def refused(method: str) -> None:
                observer.on_request_rejected("unauthenticated")

            interceptors.append(ApiKeyInterceptor(cfg.api_key, refused))
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
            ],
            interceptors=interceptors,
        )
        add_servicer(  # parses requests itself: broken bytes get INVALID_ARGUMENT
            GenerationService(self.engine, intake),
            server,
            generation_pb2.DESCRIPTOR.services_by_name["Generation"],
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        port = add_port(
            server,
            f"{cfg.host}:{cfg.port}",
            cfg.tls_cert_file,
            cfg.tls_key_file,
            cfg.tls_client_ca_file,
        )
        return server, port

    def _internal_port(self, cfg: SchedulerServiceConfig) -> tuple[grpc.aio.Server, int]:
        """The worker-link port: workers' WorkerLink, and front-ends' FrontendLink where they
        run apart (--no-client-api); mutual TLS with each service for its role's certificate
        only (common/link_auth.py), or plaintext on loopback."""
        observer = self.engine.observer
        interceptors = []
        if self.credentials is not None:
            interceptors.append(RoleInterceptor(lambda m, r: observer.on_request_rejected("peer")))
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", WORKER_LINK_MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", WORKER_LINK_MAX_MESSAGE_BYTES),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
            ],
            interceptors=interceptors,
        )
        services = [worker_link_pb2.DESCRIPTOR.services_by_name["WorkerLink"].full_name]
        worker_link_pb2_grpc.add_WorkerLinkServicer_to_server(
            WorkerLinkService(self.engine, lambda: self.role.epoch), server
        )
        if not cfg.client_api:
            frontend_link_pb2_grpc.add_FrontendLinkServicer_to_server(
                FrontendLinkService(
                    self.engine, self.role, cfg.max_model_len, lambda: self.role.role == "leader"
                ),
                server,
            )
            services.append(frontend_link_pb2.DESCRIPTOR.services_by_name["FrontendLink"].full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), server)
        address = f"{cfg.host}:{cfg.worker_port}"
        if self.credentials is None:
            return server, server.add_insecure_port(address)
        return server, server.add_secure_port(address, self.credentials.server_credentials())

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    def cluster(self) -> dict:
        return status_to_json(cluster_status(self.engine, self.role, self.cfg.max_model_len))

    async def start(self) -> None:
        if self.client_server is not None:
            await self.client_server.start()
        await self.worker_server.start()
        if self.http is not None:
            await self.http.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set("splitserve.v1.Generation", serving)
        await self.health.set("splitserve.v1.WorkerLink", serving)
        log.info(
            "scheduler_started",
            port=self.port,
            worker_port=self.worker_port,
            http_port=self.http.port if self.http is not None else 0,
            model=self.engine.model_name,
            policy=self.cfg.scheduling_policy,
            event_loop=event_loop.loop_name(),
        )

    async def stop(self, grace: float = 2.0) -> None:
        self.http_ctx.shutting_down = True
        await self.health.enter_graceful_shutdown()
        leadership = self.role.leadership
        if leadership is not None:  # a standby takes over now, not after the lease
            self.engine.may_act = lambda: False
            await leadership.resign()
        for state in list(self.engine.requests.values()):
            if self.cfg.etcd and isinstance(state, RemoteRequest):
                continue  # its front-end resubmits it to the next leader
            state.fail("the scheduler is shutting down; retry later", code="UNAVAILABLE")
        await asyncio.gather(
            self.client_server.stop(grace) if self.client_server is not None else asyncio.sleep(0),
            self.worker_server.stop(grace),
            self.http.stop() if self.http is not None else asyncio.sleep(0),
        )
        log.info("scheduler_stopped")


async def serve(cfg: SchedulerServiceConfig) -> int:
    server = SchedulerServer(cfg)
    await server.start()
    tune_gc_for_serving()  # keeps per-step cost flat with many running requests
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    leading = None
    if cfg.etcd:
        info = member_info(cfg, server.role, server.worker_port, server.http_port)
        leading = asyncio.create_task(
            lead(cfg, server.engine, server.role, info, server.credentials)
        )
        leading.add_done_callback(lambda _: stop.set())
    await stop.wait()
    code = 0
    if leading is not None and leading.done():
        exc = leading.exception()
        log.warning("leading_ended", error=f"{type(exc).__name__}: {exc}")
        code = EXIT_DEPOSED
    await server.stop()
    if leading is not None:
        leading.cancel()
        await asyncio.gather(leading, return_exceptions=True)
    return code


def main(cfg: SchedulerServiceConfig) -> None:
    configure_logging(cfg.log_level, cfg.log_json)
    if cfg.stream_interval < 0:
        raise SystemExit(
            f"--stream-interval must be 0 (adaptive) or more; got {cfg.stream_interval}"
        )
    code = event_loop.run(serve(cfg), cfg.event_loop)
    if code:
        raise SystemExit(code)
