"""The scheduler service: the serving engine behind its internal port (worker links, and the
front-end links where front-ends run apart), its metrics and dashboard state, leadership.

No client API and no HTTP here: the composition root (splitserve/scheduler_process.py) puts
the front-end's servers in front of it, in this process or apart."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common.cluster_json import status_to_json
from common.credentials import Credentials, CredentialsError
from common.link_auth import RoleInterceptor, role_credentials, target_host
from common.logging import get_logger
from common.model_source import read_vocab_size, resolve_model
from common.pb import (
    frontend_link_pb2,
    shard_link_pb2,
    shard_link_pb2_grpc,
    worker_link_pb2,
    worker_link_pb2_grpc,
)
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import SchedulerConfig
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.ha.cluster_view import SchedulerRole, cluster_status
from scheduler_svc.ha.leadership import RoleCollector
from scheduler_svc.links.frontend_link import FrontendLinkService, add_frontend_link
from scheduler_svc.links.worker_link import WorkerLinkService
from scheduler_svc.obs.dashboard_history import DashboardHistory
from scheduler_svc.obs.engine_observer import ObserverGroup
from scheduler_svc.obs.metrics import MetricsObserver
from scheduler_svc.shards.shard_router import ShardLinkService, ShardRouter

log = get_logger("splitserve.scheduler")
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


class SchedulerService:
    """The running service: the internal gRPC port around one ServingEngine."""

    def __init__(self, cfg: SchedulerServiceConfig, shard: bool = False) -> None:
        """`shard`: a step shard's service (splitserve/shard_process.py): it serves workers
        only, for the leader it dials."""
        check_config(cfg)
        self.credentials = load_credentials(cfg)
        self.cfg = cfg
        self.source = source = resolve_model(cfg.model)
        self.engine = ServingEngine(cfg, source.name, read_vocab_size(source))
        self.role = SchedulerRole(role="shard" if shard else "standby" if cfg.etcd else "leader")
        if cfg.scheduler_id:
            self.role.scheduler_id = cfg.scheduler_id
        self.shards = None if shard or cfg.client_api else ShardRouter(self.engine, self._epoch)
        if cfg.etcd and not shard:  # nothing is dispatched before this one leads and rebuilt
            self.engine.begin_rebuild()
        self.metrics = MetricsObserver(self.engine)
        self.metrics.registry.register(RoleCollector(self.role))
        self.history = DashboardHistory(self.engine)
        self.engine.observer = ObserverGroup(self.metrics, self.history)
        self.health = health.aio.HealthServicer()
        self.worker_server, self.worker_port = self._internal_port(cfg)

    def _epoch(self) -> int:
        return self.role.epoch

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
        if self.shards is not None:  # front-ends and step shards dial a leader apart
            leading = lambda: self.role.role == "leader"  # noqa: E731
            add_frontend_link(
                FrontendLinkService(
                    self.engine, self.role, cfg.max_model_len, leading, self.shards
                ),
                server,
            )
            shard_link_pb2_grpc.add_ShardLinkServicer_to_server(
                ShardLinkService(self.shards, lambda: self.role.scheduler_id, leading), server
            )
            services.append(frontend_link_pb2.DESCRIPTOR.services_by_name["FrontendLink"].full_name)
            services.append(shard_link_pb2.DESCRIPTOR.services_by_name["ShardLink"].full_name)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection((*services, reflection.SERVICE_NAME), server)
        address = f"{cfg.host}:{cfg.worker_port}"
        if self.credentials is None:
            return server, server.add_insecure_port(address)
        return server, server.add_secure_port(address, self.credentials.server_credentials())

    def cluster(self) -> dict:
        return status_to_json(cluster_status(self.engine, self.role, self.cfg.max_model_len))

    async def start(self) -> None:
        await self.worker_server.start()
        serving = health_pb2.HealthCheckResponse.SERVING
        await self.health.set("", serving)
        await self.health.set("splitserve.v1.WorkerLink", serving)

    async def begin_stop(self) -> None:
        """Step down and end what this process's clients wait on; links stay open meanwhile."""
        await self.health.enter_graceful_shutdown()
        leadership = self.role.leadership
        if leadership is not None:  # a standby takes over now, not after the lease
            self.engine.may_act = lambda: False
            await leadership.resign()
        for state in list(self.engine.requests.values()):
            if self.cfg.etcd and state.frontend_id:
                continue  # its front-end resubmits it to the next leader
            state.fail("the scheduler is shutting down; retry later", code="UNAVAILABLE")

    async def stop(self, grace: float = 2.0) -> None:
        await self.worker_server.stop(grace)
