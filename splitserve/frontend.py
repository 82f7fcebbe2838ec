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

from common import event_loop
from common.cluster_json import status_to_json
from common.credentials import Credentials, CredentialsError
from common.link_auth import role_credentials, target_host
from common.logging import configure_logging, get_logger
from common.model_source import resolve_model
from common.tokenizer import load_tokenizer
from frontend_svc.client_api import ClientApi, Operations
from frontend_svc.config import FrontendConfig
from frontend_svc.intake import Intake
from frontend_svc.leader_finder import EtcdLeader, FixedLeader
from frontend_svc.link_tls import LinkTls
from frontend_svc.scheduler_link import FrontendIdentity, SchedulerLink

log = get_logger("splitserve.frontend")


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
        self.link = SchedulerLink(
            identity,
            model_name,
            finder,
            leader_wait_timeout=cfg.leader_wait_timeout,
            tls=LinkTls(credentials),
        )
        aliases = {source.name, model_name, str(cfg.model or "")} - {""}
        self.intake = Intake(tokenizer, model_name, aliases, cfg.max_model_len)
        ops = Operations(metrics=self.link.observer.registry, cluster=self.cluster)
        self.api = ClientApi(cfg, self.link, self.intake, ops, reuse_port=True)
        self.port = self.api.port
        self.http = self.api.http
        self.http_ctx = self.api.http_ctx

    def cluster(self) -> dict | None:
        status = self.link.status
        if status is None or not self.link.connected.is_set():
            return None
        return status_to_json(status)

    async def start(self) -> None:
        await self.link.start()
        await self.api.start()
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
        await self.api.begin_stop()
        await self.link.stop()
        await self.api.stop()
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
