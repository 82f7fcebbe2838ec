"""The scheduler service's configuration; flags and SPLITSERVE_* env vars derive from it.

The groups it shares with the front-end and the worker (endpoint and TLS, cluster, model,
limits, logging) are declared once in common/config_groups.py; the scheduler's own are here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from common.config_groups import (
    ENDPOINT,
    LIMITS,
    ClientAccess,
    ClientEndpoint,
    Cluster,
    EventLoop,
    GrpcLimits,
    HttpLimits,
    Logging,
    ModelSource,
    ServedModel,
    config_group,
    opt,
)

__all__ = ["HttpLimits", "SchedulerServiceConfig"]


@config_group(ENDPOINT)
class SchedulerEndpoint:
    worker_port: int = opt(50052, "port workers (and front-ends) dial (WorkerLink, FrontendLink)")
    client_api: bool = opt(
        True,
        "serve the client APIs here (gRPC --port, OpenAI routes on --http-port); off when "
        "front-ends run apart (splitserve frontend): no tokenizer in this process",
    )


@config_group(LIMITS)
class WorkerStepLimits:
    """Per worker; a worker that reports a smaller capacity in its Register is scheduled within
    its own (scheduler_svc/engine/worker_limits.py)."""

    max_num_batched_tokens: int = opt(
        2048,
        "token budget of one step per worker; a worker whose --max-num-batched-tokens is smaller "
        "gets its own (the smaller wins)",
    )
    max_num_seqs: int = opt(
        128,
        "most requests running at once per worker; a worker whose --max-num-seqs (rows) is "
        "smaller gets its own (the smaller wins)",
    )


@config_group("scheduling")
class Scheduling:
    scheduling_policy: str = opt(
        "fcfs",
        "queue order: fcfs, priority, sjf, sjf-aging, priority-aging, fair, deadline, goodput",
    )
    shed_hopeless: bool = opt(
        False, "goodput: end a waiting request at once when it can no longer make its deadline"
    )
    aging_rate: float = opt(
        0.0, "sjf-aging: prompt tokens, priority-aging: levels, per second waited (0 = default)"
    )
    preemption_mode: str = opt("recompute", "a preempted request's KV: recompute, swap or auto")
    enable_prefix_caching: bool = opt(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = opt(True, "split long prompts over several steps")
    long_prefill_token_threshold: int = opt(0, "cap one request's prefill chunk (0 = off)")
    watermark: float = opt(0.01, "fraction of KV blocks kept free when admitting")
    speculative_config: str = opt(
        "",
        'speculative decoding, vLLM\'s JSON form, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
        "(also max_batch, min_acceptance); empty = off",
    )
    async_scheduling: bool = opt(True, "schedule step N+1 while the worker runs step N")
    stream_interval: int = opt(
        0,
        "tokens per streamed message after the first: 0 = adaptive (1 while the scheduler keeps "
        "up with its workers, up to 16 while they wait on it), N = always N (1 = each token at "
        "once)",
    )


@config_group("workers and placement")
class Placement:
    worker_wait_timeout: float = opt(30.0, "seconds a request waits for a worker")
    worker_timeout: float = opt(10.0, "seconds of silence after which a worker is lost")
    worker_queue_depth: int = opt(16, "requests handed to a worker ahead of its admission")
    placement_min_prefix_tokens: int = opt(16, "shortest cached prefix that steers placement")
    placement_balance_abs: int = opt(8, "a worker this many requests busier than the ...")
    placement_balance_rel: float = opt(2.0, "... least loaded, and this factor busier, is skipped")


@config_group("admission")
class Admission:
    max_waiting_requests: int = opt(0, "refuse new requests beyond this many waiting (0 = off)")
    tenant_rate_limit: float = opt(0.0, "requests/s each tenant may start (0 = off)")
    tenant_burst: int = opt(10, "requests a tenant may start at once above its rate")
    tenants: str = opt("", "known tenants and weights 'a:10,b:1' (empty = any tenant)")
    tenant_ttft_targets: str = opt(
        "", "goodput: each tenant's TTFT target in seconds 'a:0.5,b:2' (a request's own wins)"
    )
    tenant_tpot_targets: str = opt(
        "", "goodput: each tenant's TPOT target in seconds 'a:0.05' (a request's own wins)"
    )
    ttft_slo_ms: float = opt(0.0, "refuse requests whose predicted time to first token exceeds it")
    thrash_threshold: float = opt(0.2, "recomputed/newly computed tokens that count as thrashing")
    thrash_window_s: float = opt(10.0, "seconds over which the thrash ratio is measured")
    thrash_backpressure: bool = opt(False, "refuse new requests while the KV cache thrashes")


@config_group("failover")
class Failover:
    scheduler_id: str = opt("", "this scheduler's id in etcd (default: host-pid)")
    lease_ttl: float = opt(2.0, "seconds the leader's etcd lease lasts without a keepalive")
    takeover_wait: float = opt(
        3.0, "a new leader waits at most this long for the old one's workers and front-ends"
    )
    max_migrations: int = opt(3, "times a request may move to another worker before failing")


@config_group("step shards")
class StepShards:
    leader: str = opt(
        "",
        "`splitserve shard`: the leader's internal address HOST:PORT (with --etcd: whoever leads)",
    )


@dataclass(slots=True)
class SchedulerServiceConfig(
    ClientEndpoint,
    SchedulerEndpoint,
    ClientAccess,
    Cluster,
    ModelSource,
    ServedModel,
    WorkerStepLimits,
    HttpLimits,
    GrpcLimits,
    Scheduling,
    Placement,
    Admission,
    Failover,
    StepShards,
    Logging,
    EventLoop,
):
    FIELD_HELP: ClassVar[dict[str, str]] = {
        "credentials": "directory of this scheduler's credentials (ca.crt, tls.crt, tls.key; "
        "`splitserve credentials DIR` makes a cluster's): mutual TLS on the worker-link port, "
        "where only workers' and front-ends' certificates get in, and to etcd. Required unless "
        "--host is loopback; `splitserve up` passes its own",
    }
