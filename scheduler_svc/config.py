"""The scheduler service's configuration; flags and SPLITSERVE_* env vars derive from it."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.event_loop import EVENT_LOOPS


def _opt(default, help_text: str, **meta):
    return field(default=default, metadata={"help": help_text, **meta})


@dataclass(slots=True)
class HttpLimits:
    """What one HTTP client may hold of the server: the scheduler's and the front-end's."""

    max_request_bytes: int = _opt(
        4 * 1024 * 1024,
        "largest HTTP request body accepted; a larger one gets 413 before it is read (0 = no cap)",
    )
    http_header_timeout: float = _opt(
        10.0, "seconds an HTTP connection has to send a complete request head (0 = no limit)"
    )
    http_max_connections: int = _opt(
        1000,
        "most HTTP connections open at once (idle ones too); one more gets 503 and is closed. "
        "Keep it under the open-file limit (ulimit -n); 0 = no cap",
    )


@dataclass(slots=True)
class SchedulerServiceConfig(HttpLimits):
    host: str = _opt("0.0.0.0", "address to listen on")
    port: int = _opt(50051, "client gRPC port (Generation API)")
    worker_port: int = _opt(50052, "port workers dial (WorkerLink)")
    http_port: int = _opt(8000, "HTTP port (OpenAI API, /metrics, dashboard); 0 = off")
    model: str | None = _opt(None, "model: HF directory, .gguf file, or default SmolLM2-135M")
    served_model_name: str | None = _opt(None, "name clients use; default: the model's name")
    max_model_len: int = _opt(4096, "longest prompt + output in tokens")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step per worker")
    max_num_seqs: int = _opt(128, "most requests running at once per worker")
    scheduling_policy: str = _opt(
        "fcfs",
        "queue order: fcfs, priority, sjf, sjf-aging, priority-aging, fair, deadline, goodput",
    )
    shed_hopeless: bool = _opt(
        False, "goodput: end a waiting request at once when it can no longer make its deadline"
    )
    aging_rate: float = _opt(
        0.0, "sjf-aging: prompt tokens, priority-aging: levels, per second waited (0 = default)"
    )
    preemption_mode: str = _opt("recompute", "a preempted request's KV: recompute, swap or auto")
    enable_prefix_caching: bool = _opt(True, "reuse KV blocks of shared prompt prefixes")
    enable_chunked_prefill: bool = _opt(True, "split long prompts over several steps")
    long_prefill_token_threshold: int = _opt(0, "cap one request's prefill chunk (0 = off)")
    watermark: float = _opt(0.01, "fraction of KV blocks kept free when admitting")
    speculative_config: str = _opt(
        "",
        'speculative decoding, vLLM\'s JSON form, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
        "(also max_batch, min_acceptance); empty = off",
    )
    async_scheduling: bool = _opt(True, "schedule step N+1 while the worker runs step N")
    worker_wait_timeout: float = _opt(30.0, "seconds a request waits for a worker")
    worker_timeout: float = _opt(10.0, "seconds of silence after which a worker is lost")
    worker_queue_depth: int = _opt(16, "requests handed to a worker ahead of its admission")
    placement_min_prefix_tokens: int = _opt(16, "shortest cached prefix that steers placement")
    placement_balance_abs: int = _opt(8, "a worker this many requests busier than the ...")
    placement_balance_rel: float = _opt(2.0, "... least loaded, and this factor busier, is skipped")
    max_waiting_requests: int = _opt(0, "refuse new requests beyond this many waiting (0 = off)")
    tenant_rate_limit: float = _opt(0.0, "requests/s each tenant may start (0 = off)")
    tenant_burst: int = _opt(10, "requests a tenant may start at once above its rate")
    tenants: str = _opt("", "known tenants and weights 'a:10,b:1' (empty = any tenant)")
    tenant_ttft_targets: str = _opt(
        "", "goodput: each tenant's TTFT target in seconds 'a:0.5,b:2' (a request's own wins)"
    )
    tenant_tpot_targets: str = _opt(
        "", "goodput: each tenant's TPOT target in seconds 'a:0.05' (a request's own wins)"
    )
    ttft_slo_ms: float = _opt(0.0, "refuse requests whose predicted time to first token exceeds it")
    thrash_threshold: float = _opt(0.2, "recomputed/newly computed tokens that count as thrashing")
    thrash_window_s: float = _opt(10.0, "seconds over which the thrash ratio is measured")
    thrash_backpressure: bool = _opt(False, "refuse new requests while the KV cache thrashes")
    stream_interval: int = _opt(
        0,
        "tokens per streamed message after the first: 0 = adaptive (1 while the scheduler keeps "
        "up with its workers, up to 16 while they wait on it), N = always N (1 = each token at "
        "once)",
    )
    client_api: bool = _opt(
        True,
        "serve the client APIs here (gRPC --port, OpenAI routes on --http-port); off when "
        "front-ends run apart (splitserve frontend): no tokenizer in this process",
    )
    etcd: str = _opt(
        "", "etcd HOST:PORT: run as leader or standby, elected there (empty = the only scheduler)"
    )
    scheduler_id: str = _opt("", "this scheduler's id in etcd (default: host-pid)")
    advertise_host: str = _opt(
        "",
        "host workers and front-ends dial to reach this scheduler (published in etcd); "
        "default: --host, or this host's address when --host is 0.0.0.0",
    )
    lease_ttl: float = _opt(2.0, "seconds the leader's etcd lease lasts without a keepalive")
    takeover_wait: float = _opt(
        3.0, "a new leader waits at most this long for the old one's workers and front-ends"
    )
    max_migrations: int = _opt(3, "times a request may move to another worker before failing")
    api_key: str = _opt(
        "", "key clients must send (HTTP 'Authorization: Bearer KEY', gRPC metadata); empty = none"
    )
    max_message_bytes: int = _opt(4 * 1024 * 1024, "largest client gRPC message accepted")
    tls_cert_file: str = _opt("", "PEM certificate: serve the client API over TLS")
    tls_key_file: str = _opt("", "PEM private key for --tls-cert-file")
    tls_client_ca_file: str = _opt("", "require client certificates signed by this CA")
    credentials: str = _opt(
        "",
        "directory of this scheduler's credentials (ca.crt, tls.crt, tls.key; `splitserve "
        "credentials DIR` makes a cluster's): mutual TLS on the worker-link port, where only "
        "workers' and front-ends' certificates get in, and to etcd. Required unless --host is "
        "loopback; `splitserve up` passes its own",
    )
    event_loop: str = _opt(
        "auto", "asyncio loop: auto (uvloop when installed), uvloop, asyncio", choices=EVENT_LOOPS
    )
    log_level: str = _opt("info", "log level")
    log_json: bool = _opt(True, "JSON log lines")
