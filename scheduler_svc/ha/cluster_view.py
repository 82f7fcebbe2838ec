"""What the leader tells about the cluster: ServerInfo (gRPC GetServerInfo) and the members
list behind GET /cluster and `splitserve status`, one builder for every place that shows them."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Protocol

from common.pb import frontend_link_pb2 as fl_pb
from common.pb import generation_pb2 as gen_pb


class EngineView(Protocol):
    """What the cluster view reads of the engine (which calls it: no import back)."""

    config: Any
    model_name: str
    requests: dict[str, Any]
    frontends: dict[str, Any]
    remote_workers: dict[str, Any]  # on step shards
    shard_links: dict[str, Any]
    loras: Any  # the LoRA registry (engine/lora_registry.py)
    num_finished: int
    pacer: Any

    @property
    def num_waiting(self) -> int: ...

    def worker_stats(self) -> list[tuple[Any, Any]]: ...


VERSION = "0.1.0"


@dataclass(slots=True)
class SchedulerRole:
    """This scheduler process as the cluster view names it; the leadership module keeps it."""

    scheduler_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}")
    role: str = "leader"  # leader | standby
    epoch: int = 0  # 0: the embedded single scheduler (no etcd)
    standbys: list[dict] = field(default_factory=list)  # from etcd membership
    num_failovers: int = 0
    last_takeover_s: float = 0.0
    last_resumed: int = 0
    last_adopted: int = 0
    last_recomputed_tokens: int = 0
    leadership: Any = None  # common.coordination.Leadership while this one leads


def lora_message(adapter: Any) -> gen_pb.LoraAdapter:
    """The registry's LoraAdapter (engine/lora_registry.py) as the wire's."""
    return gen_pb.LoraAdapter(
        name=adapter.name,
        path=adapter.path,
        rank=adapter.rank,
        target_modules=adapter.target_modules,
    )


def server_info(engine: EngineView, max_model_len: int) -> gen_pb.ServerInfo:
    cfg = engine.config
    info = gen_pb.ServerInfo(
        model=engine.model_name,
        max_model_len=max_model_len,
        scheduling_policy=cfg.scheduling_policy,
        num_requests_in_flight=len(engine.requests),
        num_waiting=engine.num_waiting,
        num_requests_finished=engine.num_finished,
        version=VERSION,
    )
    info.loras.extend(lora_message(adapter) for adapter in engine.loras.describe())
    usage = engine.loras.usage()
    info.running_lora_adapters.extend(usage.running)
    info.waiting_lora_adapters.extend(usage.waiting)
    for session, stats in engine.worker_stats():
        reg = session.registration
        info.block_size = reg.block_size
        info.workers.add(
            worker_id=session.worker_id,
            address=reg.address,
            num_blocks=stats.num_total_blocks,
            num_free_blocks=stats.num_free_blocks,
            num_host_blocks=reg.num_host_blocks,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=stats.kv_usage,
            num_preemptions=stats.num_preemptions,
            num_steps=session.num_steps,
            state=session.state,
            num_swap_outs=stats.num_swap_outs,
            num_recomputed_tokens=stats.num_recomputed_tokens,
            resident_loras=sorted(getattr(session, "resident_loras", ())),
            max_loras=getattr(session, "max_loras", 0),
        )
        info.max_loras = max(info.max_loras, getattr(session, "max_loras", 0))
        info.num_running += stats.num_running
        info.num_waiting += stats.num_waiting
        info.num_preemptions += stats.num_preemptions
    for remote in engine.remote_workers.values():  # on step shards: as their last report
        info.block_size = remote.block_size
        info.workers.add(
            worker_id=remote.worker_id,
            address=f"shard {remote.shard_id}",
            num_blocks=remote.config.num_blocks,
            num_running=remote.num_running,
            num_waiting=remote.num_local_waiting,
            kv_usage=remote.kv_usage,
            state="draining" if remote.draining else "active",
        )
        info.num_running += remote.num_running
        info.num_waiting += remote.num_local_waiting
    return info


def cluster_status(
    engine: EngineView, role: SchedulerRole, max_model_len: int
) -> fl_pb.ClusterStatus:
    status = fl_pb.ClusterStatus(
        server_info=server_info(engine, max_model_len),
        num_failovers=role.num_failovers,
        last_takeover_s=role.last_takeover_s,
        last_resumed=role.last_resumed,
        last_adopted=role.last_adopted,
        last_recomputed_tokens=role.last_recomputed_tokens,
        stream_interval=engine.pacer.interval,
    )
    add = status.members.add
    add(
        kind="scheduler",
        id=role.scheduler_id,
        host=socket.gethostname(),
        pid=os.getpid(),
        role=role.role,
        epoch=role.epoch,
        state="active",
        num_running=len(engine.requests),
    )
    for other in role.standbys:
        if other.get("member_id") != role.scheduler_id:
            add(
                kind="scheduler",
                id=str(other.get("member_id", "")),
                host=str(other.get("host", "")),
                pid=int(other.get("pid", 0)),
                role="standby",
                state="standby",
                address=str(other.get("worker_address", "")),
            )
    for frontend in engine.frontends.values():
        add(
            kind="frontend",
            id=frontend.frontend_id,
            host=frontend.host,
            pid=frontend.pid,
            state="connected",
            address=frontend.http_address or frontend.grpc_address,
            num_requests=len(frontend.request_ids),
        )
    for session, stats in engine.worker_stats():
        reg = session.registration
        add(
            kind="worker",
            id=session.worker_id,
            host=reg.host or reg.address,
            pid=reg.pid,
            state=session.state,
            num_running=stats.num_running,
            kv_usage=stats.kv_usage,
            address=reg.address,
            kernels=reg.kernels,
        )
    for shard in engine.shard_links.values():
        add(
            kind="shard",
            id=shard.shard_id,
            host=shard.host,
            pid=shard.pid,
            state="connected",
            address=shard.worker_address,
            num_running=sum(w.num_running for w in shard.workers.values()),
        )
    for remote in engine.remote_workers.values():
        add(
            kind="worker",
            id=remote.worker_id,
            state="draining" if remote.draining else "active",
            num_running=remote.num_running,
            kv_usage=remote.kv_usage,
            address=f"shard {remote.shard_id}",
        )
    return status
