"""The front-end's own metrics: what its clients saw (the leader's /metrics has the rest)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ModelServerCollector(Collector):
    """The Model Server Protocol's metrics under vLLM's names, which the Gateway API Inference
    Extension's endpoint picker reads from the pods it routes to (these front-ends): the whole
    cluster's load as of the leader's last status, the numbers scheduler_svc/obs/worker_collector.py
    (model_server_metrics) emits on the leader. Every front-end reaches the same workers, so
    all report the same; the leader places requests on workers. Nothing while no leader is
    connected. vllm:lora_requests_info: the most adapter slots of a worker, the adapters of the
    running and of the waiting requests."""

    def __init__(self, model_name: str, server_info: Callable[[], Any]) -> None:
        self.model_name = model_name
        self.server_info = server_info  # the leader's ServerInfo, None while none answers

    def collect(self) -> Iterable:
        info = self.server_info()
        if info is None:
            return
        workers = [w for w in info.workers if w.state != "lost"]
        total = sum(w.num_blocks for w in workers)
        used = sum(w.num_blocks - w.num_free_blocks for w in workers)
        for name, doc, value in (
            (
                "num_requests_running",
                "Requests running on a worker",
                sum(w.num_running for w in workers),
            ),
            (
                "num_requests_waiting",
                "Requests waiting for a worker or in a worker's queue",
                info.num_waiting + sum(w.num_waiting for w in workers),
            ),
            (
                "kv_cache_usage_perc",
                "KV cache usage of all workers, 0..1 (1 = full)",
                used / total if total else 0.0,
            ),
        ):
            family = GaugeMetricFamily("vllm:" + name, doc, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of the running and of the waiting requests",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running, waiting = info.running_lora_adapters, info.waiting_lora_adapters
        lora.add_metric([str(info.max_loras), ",".join(running), ",".join(waiting)], time.time())
        yield lora


class FrontendObserver:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.accepted = Counter(
            "splitserve:frontend_requests_accepted", "requests sent on to the leader", registry=r
        )
        self.rejected = Counter(
            "splitserve:frontend_requests_rejected",
            "requests refused before reaching the leader",
            ["reason"],
            registry=r,
        )
        self.finished = Counter(
            "splitserve:frontend_requests_finished", "requests ended", ["finish_reason"], registry=r
        )
        self.tokens = Counter(
            "splitserve:frontend_generation_tokens", "output tokens streamed", registry=r
        )
        self.ttft = Histogram(
            "splitserve:frontend_time_to_first_token_seconds",
            "arrival at this front-end to the first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.epoch = Gauge("splitserve:leader_epoch", "epoch of the leader followed", registry=r)
        self.leader_changes = Counter(
            "splitserve:frontend_leader_changes",
            "times this front-end moved to a new leader",
            registry=r,
        )

    def watch_leader(self, model_name: str, server_info: Callable[[], Any]) -> None:
        """Serve the vllm: metrics from the leader's ServerInfo (None while none answers)."""
        self.registry.register(ModelServerCollector(model_name, server_info))

    def on_request_accepted(self, state: Any) -> None:
        self.accepted.inc()

    def on_request_rejected(self, reason: str) -> None:
        self.rejected.labels(reason).inc()

    def on_tokens(self, state: Any, num_new: int, now: float) -> None:
        self.tokens.inc(num_new)
        if len(state.output_token_ids) == num_new:
            self.ttft.observe(max(0.0, now - state.arrival_time))

    def on_request_finished(self, state: Any) -> None:
        self.finished.labels(str(state.finish_reason)).inc()
        state.finish_time = time.monotonic()
