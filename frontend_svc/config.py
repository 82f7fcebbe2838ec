"""The front-end's configuration; flags and SPLITSERVE_* env vars derive from it.

Its groups are the scheduler's where they mean the same (common/config_groups.py); its own is
how it follows the leader.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config_groups import (
    CLUSTER,
    ClientAccess,
    ClientEndpoint,
    Cluster,
    EventLoop,
    GrpcLimits,
    HttpLimits,
    LeaderAddress,
    Logging,
    ModelSource,
    ServedModel,
    config_group,
    opt,
)


@config_group(CLUSTER)
class FrontendCluster:
    frontend_id: str = opt("", "this front-end's id (default: host-pid)")
    leader_wait_timeout: float = opt(
        15.0, "without a leader this long, requests in flight fail with UNAVAILABLE"
    )


@dataclass(slots=True)
class FrontendConfig(
    ClientEndpoint,
    ClientAccess,
    LeaderAddress,
    Cluster,
    FrontendCluster,
    ModelSource,
    ServedModel,
    HttpLimits,
    GrpcLimits,
    Logging,
    EventLoop,
):
    FIELD_HELP: ClassVar[dict[str, str]] = {
        "model": "model (for its tokenizer and chat template): a HF directory, a .gguf file, or "
        "empty for the default SmolLM2-135M-Instruct",
        "credentials": "directory of this front-end's credentials (ca.crt, tls.crt, tls.key): "
        "mutual TLS to the leader scheduler (only a certificate naming splitserve-scheduler is "
        "trusted) and to etcd. Required unless the scheduler is on loopback",
    }
