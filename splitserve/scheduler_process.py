"""`splitserve scheduler`: the scheduler service with the front-end's servers in front of it.

With --client-api (the embedded mode `make run` uses) the front-end runs in this process over
the in-process SchedulerClient (splitserve/embedded.py): the same front-end code as
`splitserve frontend`, without the link. Without it, front-ends run apart and this process's
HTTP port serves operations only (probes, /metrics, /cluster, the dashboard, priorities).
"""

from __future__ import annotations

import asyncio
import signal

from common import event_loop
from common.gc_tuning import tune_gc_for_serving
from common.logging import configure_logging, get_logger
from common.tokenizer import load_tokenizer
from frontend_svc.client_api import ClientApi, Operations
from frontend_svc.intake import Intake
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.ha.leadership import lead, member_info
from scheduler_svc.service import SchedulerService
from splitserve.embedded import InProcessScheduler

log = get_logger("splitserve.scheduler")
EXIT_DEPOSED = 3  # this scheduler led and lost its lease (or etcd): start it again as a standby


class SchedulerServer:
    """One scheduler process: the service, and the client API or the operations port."""

    def __init__(self, cfg: SchedulerServiceConfig) -> None:
        self.cfg = cfg
        self.service = SchedulerService(cfg)
        self.engine = self.service.engine
        self.role = self.service.role
        self.credentials = self.service.credentials
        self.metrics = self.service.metrics
        self.history = self.service.history
        self.client = InProcessScheduler(self.engine)
        self.intake: Intake | None = None
        if cfg.client_api:
            source = self.service.source
            model_name = cfg.served_model_name or source.name
            aliases = {source.name, model_name, str(cfg.model or "")} - {""}
            self.intake = Intake(load_tokenizer(source), model_name, aliases, cfg.max_model_len)
        ops = Operations(
            metrics=self.metrics.registry,
            cluster=self.service.cluster,
            dashboard=self.history.snapshot,
        )
        self.api = ClientApi(cfg, self.client, self.intake, ops)
        self.http_ctx = self.api.http_ctx

    @property
    def port(self) -> int:
        return self.api.port

    @property
    def worker_port(self) -> int:
        return self.service.worker_port

    @property
    def http_port(self) -> int:
        return self.api.http_port

    @property
    def http(self):
        return self.api.http

    def cluster(self) -> dict:
        return self.service.cluster()

    async def start(self) -> None:
        await self.api.start()
        await self.service.start()
        log.info(
            "scheduler_started",
            port=self.port,
            worker_port=self.worker_port,
            http_port=self.http_port,
            model=self.engine.model_name,
            policy=self.cfg.scheduling_policy,
            event_loop=event_loop.loop_name(),
        )

    async def stop(self, grace: float = 2.0) -> None:
        await self.api.begin_stop()
        await self.service.begin_stop()
        await asyncio.gather(self.api.stop(grace), self.service.stop(grace))
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
