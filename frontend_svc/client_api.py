"""The client-facing servers of a front-end: the Generation gRPC API (with health and
reflection) and the HTTP server (OpenAI routes, /metrics, /ready, /cluster, the dashboard), in
front of any SchedulerClient. A front-end process apart and the embedded mode both run this.

Without an intake (a scheduler whose front-ends run apart) there is no client gRPC port and the
HTTP port serves operations only: probes, /metrics, /cluster, the dashboard, priorities.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.pb import generation_pb2
from common.safe_handlers import add_servicer
from common.tls import add_port
from frontend_svc.auth import ApiKeyInterceptor
from frontend_svc.client_streams import SchedulerClient
from frontend_svc.generation_service import GenerationService
from frontend_svc.http import HttpContext, HttpServer, create_app
from frontend_svc.intake import Intake


@dataclass(slots=True)
class Operations:
    """What the HTTP port shows beside the client API, from whoever runs this front-end."""

    metrics: Any = None  # a prometheus CollectorRegistry for GET /metrics
    cluster: Callable[[], dict | None] | None = None  # GET /cluster (None: no leader)
    dashboard: Callable[[], dict] | None = None  # the dashboard's state (None: no dashboard)
    workers: Callable[[], list[str]] | None = None  # for /ready; default: the client's


class ClientApi:
    """`cfg` carries the client endpoint, TLS, limits and API key fields (FrontendConfig's, or
    the scheduler's in the embedded mode: the same groups)."""

    def __init__(
        self,
        cfg: Any,
        scheduler: SchedulerClient | None,
        intake: Intake | None,
        ops: Operations,
        reuse_port: bool = False,
    ) -> None:
        self.cfg = cfg
        self.scheduler = scheduler
        self.health = health.aio.HealthServicer()
        rejected = scheduler.observer.on_request_rejected if scheduler is not None else _ignore
        self.server: grpc.aio.Server | None = None
        self.port = 0
        if intake is not None and scheduler is not None:
            # the adapters requests may name, as the scheduler last said (gRPC and HTTP alike)
            intake.lora_names = lambda: {a.name for a in scheduler.lora_adapters()}
            self.server, self.port = self._grpc(cfg, scheduler, intake, rejected, reuse_port)
        self.http_ctx = HttpContext(
            scheduler,
            intake,
            cfg.api_key,
            ops.metrics,
            dashboard=ops.dashboard,
            cluster=ops.cluster,
            workers=ops.workers,
            rejected=rejected,
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
                reuse_port=reuse_port,
            )

    def _grpc(
        self,
        cfg: Any,
        scheduler: SchedulerClient,
        intake: Intake,
        rejected: Callable[[str], Any],
        reuse_port: bool,
    ) -> tuple[grpc.aio.Server, int]:
        interceptors = []
        if cfg.api_key:
            interceptors.append(
                ApiKeyInterceptor(cfg.api_key, lambda m: rejected("unauthenticated"))
            )
        options = [
            ("grpc.max_receive_message_length", cfg.max_message_bytes),
            ("grpc.max_send_message_length", cfg.max_message_bytes),
        ]
        if reuse_port:
            options.append(("grpc.so_reuseport", 1))
        server = grpc.aio.server(options=options, interceptors=interceptors)
        generation = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
        # parses requests itself: broken bytes get INVALID_ARGUMENT
        add_servicer(GenerationService(scheduler, intake), server, generation)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                generation.full_name,
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

    @property
    def http_port(self) -> int:
        return self.http.port if self.http is not None else 0

    async def start(self) -> None:
        if self.server is not None:
            await self.server.start()
        if self.http is not None:
            await self.http.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set("splitserve.v1.Generation", serving)

    async def begin_stop(self) -> None:
        """Probes say not ready; requests in flight go on."""
        self.http_ctx.shutting_down = True
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace: float = 2.0) -> None:
        await asyncio.gather(
            self.server.stop(grace) if self.server is not None else asyncio.sleep(0),
            self.http.stop() if self.http is not None else asyncio.sleep(0),
        )


def _ignore(reason: str) -> None:
    """No client API here: nothing counts refusals."""
