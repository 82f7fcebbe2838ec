"""`splitserve shard`: a step shard. Workers dial it as they would dial a scheduler; it runs
their core schedulers and step loops for the leader it dials (--leader, or the leader etcd
names), which keeps the global queue and places every request (docs/architecture.md, "Step
shards"). No client port: its HTTP port serves probes and /metrics only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket

from common import event_loop
from common.coordination import Coordinator
from common.gc_tuning import tune_gc_for_serving
from common.link_auth import scheduler_channel
from common.logging import configure_logging, get_logger
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.ha.leadership import advertised_host
from scheduler_svc.obs.engine_observer import ObserverGroup
from scheduler_svc.service import WORKER_LINK_MAX_MESSAGE_BYTES, SchedulerService
from scheduler_svc.shards.shard_agent import ShardAgent

log = get_logger("splitserve.shard")
LEADER_LINK_OPTIONS = [
    ("grpc.max_receive_message_length", WORKER_LINK_MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", WORKER_LINK_MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 5_000),
]


class ShardServer:
    def __init__(self, cfg: SchedulerServiceConfig) -> None:
        self.cfg = cfg
        self.service = SchedulerService(cfg, shard=True)
        self.engine = self.service.engine
        self.role = self.service.role
        if not cfg.scheduler_id:
            self.role.scheduler_id = f"shard-{socket.gethostname()}-{os.getpid()}"
        address = f"{advertised_host(cfg)}:{self.service.worker_port}"
        credentials = self.service.credentials
        self.agent = ShardAgent(
            self.engine,
            self.role.scheduler_id,
            address,
            lambda target: scheduler_channel(
                target, credentials, options=LEADER_LINK_OPTIONS, aio=True
            ),
            self._set_epoch,
        )
        self.engine.observer = ObserverGroup(self.engine.observer, self.agent)

    def _set_epoch(self, epoch: int) -> None:
        self.role.epoch = epoch

    async def leaders(self, into: asyncio.Queue[str]) -> None:
        """The leader's internal address: --leader, or each one etcd names in turn."""
        if not self.cfg.etcd:
            into.put_nowait(self.cfg.leader)
            return
        coord = Coordinator(self.cfg.etcd, credentials=self.service.credentials)
        try:
            async for leader in coord.watch_leader():
                if leader is not None:
                    into.put_nowait(leader.info["worker_address"])
        finally:
            await coord.close()


async def serve(cfg: SchedulerServiceConfig) -> int:
    server = ShardServer(cfg)
    await server.service.start()
    tune_gc_for_serving()
    log.info(
        "shard_started",
        shard_id=server.role.scheduler_id,
        worker_port=server.service.worker_port,
        leader=cfg.leader or f"etcd {cfg.etcd}",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    leaders: asyncio.Queue[str] = asyncio.Queue()
    tasks = [
        asyncio.create_task(server.leaders(leaders)),
        asyncio.create_task(server.agent.run(leaders)),
    ]
    await stop.wait()
    for task in tasks:
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*tasks, return_exceptions=True)
    await server.service.begin_stop()
    await server.service.stop()
    log.info("shard_stopped")
    return 0


def main(cfg: SchedulerServiceConfig) -> None:
    configure_logging(cfg.log_level, cfg.log_json)
    if not cfg.leader and not cfg.etcd:
        raise SystemExit("splitserve shard needs the leader: --leader HOST:PORT or --etcd")
    cfg.client_api = False
    code = event_loop.run(serve(cfg), cfg.event_loop)
    if code:
        raise SystemExit(code)
