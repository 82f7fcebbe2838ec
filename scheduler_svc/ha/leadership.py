"""A scheduler's life under etcd: a standby until elected, then the leader until its lease is
lost (common/coordination.py holds the election; nothing here votes).

On election the engine is still rebuilding (it began so at start): the new leader waits for the
workers and front-ends the old leader published in etcd to reconnect and report what they hold,
at most --takeover-wait seconds, then adopts or queues their requests (engine.finish_rebuild).
While it leads it publishes its members' names and the failover history twice a second. A leader
whose lease is lost (etcd deleted it, or it was frozen past the lease) stops acting at once
(engine.may_act) and the process exits; `splitserve up` or the orchestrator starts it again, as
a standby.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from common.coordination import Coordinator, Leadership, cancel_and_wait
from common.logging import get_logger
from scheduler_svc.ha.cluster_view import SchedulerRole
from scheduler_svc.ha.leader_probe import depose_dead_leaders

if TYPE_CHECKING:
    from common.credentials import Credentials
    from scheduler_svc.config import SchedulerServiceConfig
    from scheduler_svc.engine.serving_engine import ServingEngine

log = get_logger("splitserve.leadership")
STATE_KEY = "state"  # the leader's published members and failover history
PUBLISH_INTERVAL_S = 0.5


class LeadershipLost(Exception):
    """This scheduler led and does not any more: the process must exit."""


def advertised_host(cfg: SchedulerServiceConfig) -> str:
    if cfg.advertise_host:
        return cfg.advertise_host
    if cfg.host not in ("", "0.0.0.0", "::"):
        return cfg.host
    return socket.gethostbyname(socket.gethostname())  # a container's own address


def member_info(cfg: SchedulerServiceConfig, role: SchedulerRole, worker_port: int, http_port: int):
    host = advertised_host(cfg)
    address = f"{host}:{worker_port}"
    return {
        "scheduler_id": role.scheduler_id,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "worker_address": address,  # workers and front-ends dial the same internal port
        "frontend_address": address,
        "http_address": f"{host}:{http_port}" if http_port else "",
    }


async def lead(
    cfg: SchedulerServiceConfig,
    engine: ServingEngine,
    role: SchedulerRole,
    info: dict,
    credentials: Credentials | None = None,
) -> None:
    """Campaign, take over, lead; raises LeadershipLost when the lease is gone. With the
    scheduler's credentials etcd is mutual TLS, and its certificate is the one etcd lets write
    the leader key; without, etcd must be on loopback."""
    coord = Coordinator(cfg.etcd, lease_ttl=cfg.lease_ttl, credentials=credentials)
    await coord.connect()
    await coord.register("scheduler", role.scheduler_id, info)
    standbys = asyncio.create_task(_follow_schedulers(coord, role))
    try:
        log.info("standby", scheduler_id=role.scheduler_id, etcd=cfg.etcd)
        probe = asyncio.create_task(depose_dead_leaders(coord, role.scheduler_id))
        try:
            leadership = await coord.campaign(role.scheduler_id, info)
        finally:
            await cancel_and_wait([probe])
        await _take_over(cfg, engine, role, coord, leadership)
        await _publish_while_leading(engine, role, coord, leadership)
    finally:
        standbys.cancel()
        await coord.close()
    raise LeadershipLost("this scheduler's etcd lease is gone; another one leads now")


async def _take_over(cfg, engine, role: SchedulerRole, coord: Coordinator, leadership) -> None:
    elected_at = time.monotonic()
    role.role = "leader"
    role.epoch = leadership.epoch
    role.leadership = leadership
    engine.may_act = leadership.valid
    previous = await coord.get_json(STATE_KEY) or {}
    workers = set(previous.get("workers", ()))
    frontends = set(previous.get("frontends", ()))
    deadline = elected_at + cfg.takeover_wait
    while time.monotonic() < deadline and not (
        workers <= {s.worker_id for s in engine.sessions.values() if not s.lost}
        and frontends <= set(engine.frontends)
    ):
        await asyncio.sleep(0.01)
    resumed, adopted, recomputed = engine.finish_rebuild()
    took = time.monotonic() - elected_at
    if previous:
        role.last_resumed, role.last_adopted = resumed, adopted
        role.last_recomputed_tokens = recomputed
        role.num_failovers = int(previous.get("failovers", 0)) + 1
        # from the old leader's last sign of life (its last publish) to this one serving
        role.last_takeover_s = max(took, time.time() - float(previous.get("published_at", 0)))
    log.info(
        "leader_ready",
        epoch=role.epoch,
        takeover=bool(previous),
        rebuild_s=round(took, 3),
        outage_s=round(role.last_takeover_s, 3),
        resumed=resumed,
        adopted=adopted,
        recomputed_tokens=recomputed,
        missing_workers=sorted(workers - set(engine.sessions)),
        missing_frontends=sorted(frontends - set(engine.frontends)),
    )


async def _publish_while_leading(
    engine, role: SchedulerRole, coord: Coordinator, leadership: Leadership
) -> None:
    while not leadership.lost.is_set():
        if leadership.valid():
            state = {
                "epoch": role.epoch,
                "scheduler_id": role.scheduler_id,
                "workers": sorted(s.worker_id for s in engine.sessions.values() if not s.lost),
                "frontends": sorted(engine.frontends),
                "failovers": role.num_failovers,
                "last_takeover_s": role.last_takeover_s,
                "published_at": time.time(),
            }
            try:
                await coord.put_json(STATE_KEY, state)
            except Exception as exc:  # noqa: BLE001 - etcd away: the lease decides, not this
                log.warning("publish_failed", error=str(exc))
        try:
            await asyncio.wait_for(leadership.lost.wait(), PUBLISH_INTERVAL_S)
        except TimeoutError:
            pass
    role.role = "deposed"
    role.leadership = None
    log.warning("leadership_lost", epoch=role.epoch, scheduler_id=role.scheduler_id)


async def _follow_schedulers(coord: Coordinator, role: SchedulerRole) -> None:
    while True:
        try:
            role.standbys = await coord.members("scheduler")
        except Exception:  # noqa: BLE001 - shown as stale until etcd answers again
            pass
        await asyncio.sleep(1.0)


class RoleCollector(Collector):
    """splitserve:leader_epoch, splitserve:is_leader, splitserve:failovers_total,
    splitserve:last_takeover_seconds, read at scrape time."""

    def __init__(self, role: SchedulerRole) -> None:
        self.role = role

    def collect(self) -> Iterable:
        role = self.role
        yield GaugeMetricFamily(
            "splitserve:leader_epoch", "epoch of this scheduler's leadership", role.epoch
        )
        yield GaugeMetricFamily(
            "splitserve:is_leader", "1 on the leader scheduler", 1.0 if role.role == "leader" else 0
        )
        yield CounterMetricFamily(
            "splitserve:failovers", "leader takeovers the cluster has seen", role.num_failovers
        )
        yield GaugeMetricFamily(
            "splitserve:last_takeover_seconds",
            "the last takeover: old leader's last sign of life to the new one serving",
            role.last_takeover_s,
        )
