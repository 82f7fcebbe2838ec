"""`splitserve frontend`: the client APIs (OpenAI HTTP, gRPC Generation) in a process of their
own, in front of the leader scheduler. Validation, chat templates, tokenization,
detokenization and stop strings run here; token ids travel over the FrontendLink
(frontend_svc/scheduler_link.py). Several front-ends may share one host's ports (SO_REUSEPORT).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from common import event_loop
from common.credentials import Credentials, CredentialsError
from common.link_auth import role_credentials, target_host
from common.logging import configure_logging, get_logger
from common.model_source import resolve_model
from common.pb import generation_pb2
from common.safe_handlers import add_servicer
from common.tls import add_port
from common.tokenizer import load_tokenizer
from frontend_svc.leader_finder import EtcdLeader, FixedLeader
from frontend_svc.link_tls import LinkTls
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink
from scheduler_svc.auth import ApiKeyInterceptor
from scheduler_svc.cluster_view import status_to_json
from scheduler_svc.config import HttpLimits
from scheduler_svc.core import FinishReason, RequestRejected
from scheduler_svc.generation_service import GenerationService
from scheduler_svc.http import HttpContext, HttpServer, create_app
from scheduler_svc.intake import Intake
from scheduler_svc.policy_control import PriorityChangeError

log = get_logger("splitserve.frontend")


def _opt(default, help_text: str):
    return field(default=default, metadata={"help": help_text})


@dataclass(slots=True)
class FrontendConfig(HttpLimits):
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(50051, "client gRPC port (Generation API; shared by front-ends on a host)")
    http_port: int = _opt(8000, "HTTP port (OpenAI API, /cluster; shared on a host); 0 = off")
    scheduler: str = _opt(
        "localhost:50052", "the scheduler's internal address HOST:PORT (without --etcd)"
    )
    etcd: str = _opt("", "etcd HOST:PORT: follow the leader scheduler named there")
    frontend_id: str = _opt("", "this front-end's id (default: host-pid)")
    advertise_host: str = _opt(
        "", "host clients reach this front-end at, for /cluster (default: --host, or host name)"
    )
    model: str | None = _opt(None, "model (for its tokenizer and chat template)")
    served_model_name: str | None = _opt(None, "name clients use; default: the model's name")
    max_model_len: int = _opt(4096, "longest prompt + output in tokens")
    leader_wait_timeout: float = _opt(
        15.0, "without a leader this long, requests in flight fail with UNAVAILABLE"
    )
    api_key: str = _opt("", "key clients must send; empty = none")
    tls_cert_file: str = _opt("", "PEM certificate: serve the client API (gRPC, HTTP) over TLS")
    tls_key_file: str = _opt("", "PEM private key for --tls-cert-file")
    tls_client_ca_file: str = _opt("", "require client certificates signed by this CA")
    credentials: str = _opt(
        "",
        "directory of this front-end's credentials (ca.crt, tls.crt, tls.key): mutual TLS to "
        "the leader scheduler (only a certificate naming splitserve-scheduler is trusted) and "
        "to etcd. Required unless the scheduler is on loopback",
    )
    max_message_bytes: int = _opt(4 * 1024 * 1024, "largest client gRPC message accepted")
    event_loop: str = _opt("auto", "asyncio loop: auto, uvloop, asyncio")
    log_level: str = _opt("info", "log level")
    log_json: bool = _opt(True, "JSON log lines")


def load_credentials(cfg: FrontendConfig) -> Credentials | None:
    """The front-end's credentials; without them it reaches a leader on loopback only."""
    links = {"reach the scheduler through": target_host(cfg.etcd or cfg.scheduler)}
    try:
        return role_credentials("frontend", cfg.credentials, links)
    except CredentialsError as exc:
        raise SystemExit(f"--credentials: {exc}") from exc


class FrontendServer:
    def __init__(self, cfg: FrontendConfig) -> None:
        self.cfg = cfg
        source = resolve_model(cfg.model)
        tokenizer = load_tokenizer(source)
        model_name = cfg.served_model_name or source.name
        shown = cfg.advertise_host or (
            cfg.host if cfg.host not in ("", "0.0.0.0", "::") else socket.gethostname()
        )
        identity = FrontendIdentity(
            frontend_id=cfg.frontend_id or f"{socket.gethostname()}-{os.getpid()}",
            host=socket.gethostname(),
            pid=os.getpid(),
            http_address=f"{shown}:{cfg.http_port}" if cfg.http_port else "",
            grpc_address=f"{shown}:{cfg.port}",
        )
        credentials = load_credentials(cfg)
        finder = (
            EtcdLeader(cfg.etcd, credentials=credentials)
            if cfg.etcd
            else FixedLeader(cfg.scheduler)
        )
        link_tls = LinkTls(credentials)
        self.link = SchedulerLink(
            identity,
            model_name,
            finder,
            finish_reasons={r.value: r for r in FinishReason},
            rejected_error=RequestRejected,
            priority_error=PriorityChangeError,
            leader_wait_timeout=cfg.leader_wait_timeout,
            tls=link_tls,
        )
        aliases = {source.name, model_name, str(cfg.model or "")} - {""}
        self.intake = Intake(tokenizer, model_name, aliases, cfg.max_model_len)
        interceptors = []
        if cfg.api_key:
            observer = self.link.observer
            interceptors.append(
                ApiKeyInterceptor(cfg.api_key, lambda m: observer.on_request_rejected("auth"))
            )
        self.server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 1),
            ],
            interceptors=interceptors,
        )
        add_servicer(
            GenerationService(self.link, self.intake),  # type: ignore[arg-type]
            self.server,
            generation_pb2.DESCRIPTOR.services_by_name["Generation"],
        )
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = add_port(
            self.server,
            f"{cfg.host}:{cfg.port}",
            cfg.tls_cert_file,
            cfg.tls_key_file,
            cfg.tls_client_ca_file,
        )
        self.http_ctx = HttpContext(
            self.link,  # type: ignore[arg-type]
            self.intake,
            cfg.api_key,
            self.link.observer,  # type: ignore[arg-type]
            cluster=self.cluster,
        )
        self.http = None
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
                reuse_port=True,
            )

    def cluster(self) -> dict | None:
        status = self.link.status
        if status is None or not self.link.connected.is_set():
            return None
        return status_to_json(status)

    async def start(self) -> None:
        await self.link.start()
        await self.server.start()
        if self.http is not None:
            await self.http.start()
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "frontend_started",
            frontend_id=self.link.identity.frontend_id,
            port=self.port,
            http_port=self.http.port if self.http is not None else 0,
            leader_from=self.cfg.etcd or self.cfg.scheduler,
            internal_tls=self.link.tls.on,
            client_tls=bool(self.cfg.tls_cert_file),
        )

    async def stop(self) -> None:
        self.http_ctx.shutting_down = True
        await self.health.enter_graceful_shutdown()
        await self.link.stop()
        await asyncio.gather(
            self.server.stop(2.0),
            self.http.stop() if self.http is not None else asyncio.sleep(0),
        )
        log.info("frontend_stopped")


async def serve(cfg: FrontendConfig) -> None:
    server = FrontendServer(cfg)
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop()


def main(cfg: FrontendConfig) -> None:
    configure_logging(cfg.log_level, cfg.log_json)
    event_loop.run(serve(cfg), cfg.event_loop)
