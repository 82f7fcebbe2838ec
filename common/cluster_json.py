"""GET /cluster's body from the leader's ClusterStatus: the same JSON on the scheduler and on
every front-end (which has the status from the FrontendLink)."""

from __future__ import annotations

from common.pb import frontend_link_pb2 as fl_pb


def status_to_json(status: fl_pb.ClusterStatus) -> dict:
    """GET /cluster's body."""
    groups: dict[str, list[dict]] = {"schedulers": [], "shards": [], "frontends": [], "workers": []}
    for m in status.members:
        entry: dict = {"id": m.id, "host": m.host, "pid": m.pid, "state": m.state}
        if m.kind == "scheduler":
            entry |= {"role": m.role, "epoch": m.epoch}
            groups["schedulers"].append(entry)
        elif m.kind == "frontend":
            entry |= {"address": m.address, "requests_in_flight": m.num_requests}
            groups["frontends"].append(entry)
        elif m.kind == "shard":
            entry |= {"address": m.address, "running": m.num_running}
            groups["shards"].append(entry)
        else:
            entry |= {
                "running": m.num_running,
                "kv_usage": round(m.kv_usage, 4),
                "kernels": m.kernels,
            }
            groups["workers"].append(entry)
    info = status.server_info
    return {
        "model": info.model,
        "epoch": max((m.epoch for m in status.members if m.role == "leader"), default=0),
        "failovers": status.num_failovers,
        "last_takeover": {
            "seconds": round(status.last_takeover_s, 3),
            "resumed": status.last_resumed,
            "adopted": status.last_adopted,
            "recomputed_tokens": status.last_recomputed_tokens,
        },
        "requests_in_flight": info.num_requests_in_flight,
        "waiting": info.num_waiting,
        **groups,
    }
