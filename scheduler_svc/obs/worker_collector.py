"""Per-worker gauges and counters, read from the engine when Prometheus scrapes, labelled
`worker`; the Model Server Protocol's vllm: families and the SLO admission state likewise."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler_svc.engine.lora_registry import LoraUsage

if TYPE_CHECKING:
    from scheduler_svc.engine.serving_engine import ServingEngine

P = "splitserve:"
MSP = "vllm:"  # the Model Server Protocol's names (model_server_metrics)


class WorkerCollector(Collector):
    """Per-worker gauges and counters read from the engine when Prometheus scrapes."""

    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable:
        engine = self.engine
        lw = ["worker"]
        g = {
            "running": GaugeMetricFamily(
                P + "num_requests_running", "Requests running on the worker", labels=lw
            ),
            "waiting": GaugeMetricFamily(
                P + "num_requests_waiting",
                "Requests waiting in the worker's scheduler (see num_requests_queued for the "
                "global queue)",
                labels=lw,
            ),
            "swapped": GaugeMetricFamily(
                P + "num_requests_swapped", "Requests swapped out to host memory", labels=lw
            ),
            "kv": GaugeMetricFamily(
                P + "kv_cache_usage_perc", "KV cache usage, 0..1 (1 = full)", labels=lw
            ),
            "blocks_used": GaugeMetricFamily(
                P + "kv_cache_blocks_used", "KV blocks in use", labels=lw
            ),
            "blocks_total": GaugeMetricFamily(
                P + "kv_cache_blocks_total", "KV blocks the worker has", labels=lw
            ),
        }
        c = {
            "num_preemptions": CounterMetricFamily(P + "num_preemptions", "Preemptions", labels=lw),
            "prefix_cache_queries": CounterMetricFamily(
                P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=lw
            ),
            "prefix_cache_hits": CounterMetricFamily(
                P + "prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=lw
            ),
            "num_recomputed_tokens": CounterMetricFamily(
                P + "recomputed_tokens", "Tokens computed again after a preemption", labels=lw
            ),
            "num_prefill_tokens": CounterMetricFamily(
                P + "scheduled_prefill_tokens", "Tokens scheduled as prefill", labels=lw
            ),
            "num_decode_tokens": CounterMetricFamily(
                P + "scheduled_decode_tokens", "Tokens scheduled as decode", labels=lw
            ),
            "num_steps": CounterMetricFamily(P + "scheduler_steps", "schedule() calls", labels=lw),
        }
        sessions = running = waiting = used = total = 0
        for session, stats in engine.worker_stats():
            if session.lost:
                continue
            sessions += 1
            running += stats.num_running
            waiting += stats.num_waiting
            used += stats.num_used_blocks
            total += stats.num_total_blocks
            w = [session.worker_id]
            g["running"].add_metric(w, stats.num_running)
            g["waiting"].add_metric(w, stats.num_waiting)
            g["swapped"].add_metric(w, getattr(stats, "num_swapped", 0))
            g["kv"].add_metric(w, stats.kv_usage)
            g["blocks_used"].add_metric(w, stats.num_used_blocks)
            g["blocks_total"].add_metric(w, stats.num_total_blocks)
            for name, family in c.items():
                family.add_metric(w, getattr(stats, name, 0))
        yield from g.values()
        yield from c.values()
        yield GaugeMetricFamily(P + "workers_attached", "Workers attached", value=sessions)
        queued = getattr(engine, "num_waiting", None)
        if queued is None:  # engines without a global queue
            queued = len(getattr(engine, "unassigned", ()))
        yield GaugeMetricFamily(
            P + "num_requests_queued",
            "Requests in the global queue, on no worker yet",
            value=queued,
        )
        yield GaugeMetricFamily(
            P + "num_requests_in_flight",
            "Requests accepted and not finished",
            value=len(engine.requests),
        )
        loras = getattr(engine, "loras", None)
        yield from model_server_metrics(
            getattr(engine, "model_name", ""),
            running,
            queued + waiting,
            used / total if total else 0.0,
            loras.usage() if loras is not None else None,
        )
        slo = getattr(engine, "slo", None)
        if slo is not None:
            yield from slo_metrics(slo)
        predictor = getattr(getattr(engine, "policy", None), "predictor", None)
        if predictor is not None:  # the goodput policy's output-length predictions
            err = predictor.error
            yield GaugeMetricFamily(
                P + "output_length_prediction_abs_error_tokens",
                "Mean |predicted - actual| output tokens of finished requests",
                value=err.mean_abs_tokens,
            )
            yield GaugeMetricFamily(
                P + "output_length_prediction_bias_tokens",
                "Mean predicted - actual output tokens (> 0: predictions too long)",
                value=err.mean_signed_tokens,
            )


def model_server_metrics(
    model: str, running: int, waiting: int, kv_usage: float, loras: LoraUsage | None = None
) -> Iterable:
    """The Model Server Protocol's metrics, under vLLM's names: the Gateway API Inference
    Extension's endpoint picker and vLLM dashboards read these. The same numbers as the
    splitserve: families, for the whole scheduler: running and waiting summed over the workers
    (waiting includes the global queue), KV usage = used / total blocks of all workers, and
    vllm:lora_requests_info (lora_requests_info). frontend_svc/observer.py emits the same names
    from the leader's status."""
    labels = ["model_name"]
    for name, doc, value in (
        ("num_requests_running", "Requests running on a worker", running),
        ("num_requests_waiting", "Requests waiting for a worker or in a worker's queue", waiting),
        ("kv_cache_usage_perc", "KV cache usage of all workers, 0..1 (1 = full)", kv_usage),
    ):
        family = GaugeMetricFamily(MSP + name, doc, labels=labels)
        family.add_metric([model], value)
        yield family
    yield lora_requests_info(loras or LoraUsage())


def lora_requests_info(usage: LoraUsage) -> GaugeMetricFamily:
    """vllm:lora_requests_info: the most adapter slots of a worker and the adapters of the
    running and of the waiting requests (comma-separated), which the Gateway API Inference
    Extension routes by; its value is the time of the scrape."""
    lora = GaugeMetricFamily(
        MSP + "lora_requests_info",
        "LoRA adapters of the running and of the waiting requests",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    lora.add_metric(
        [str(usage.max_loras), ",".join(usage.running), ",".join(usage.waiting)], time.time()
    )
    return lora


def slo_metrics(slo) -> Iterable:
    """Thrash backpressure and SLO admission (scheduler_svc/engine/slo_admission.py), read at
    scrape time."""
    thrash = slo.thrash
    thrashing = thrash.update()
    ratio = thrash.ratio()
    yield GaugeMetricFamily(
        P + "kv_thrash_ratio",
        f"Recomputed / newly computed tokens over the last {thrash.window_s:g} s",
        value=ratio if ratio < 1e9 else 1e9,
    )
    yield GaugeMetricFamily(
        P + "kv_thrashing",
        "1 while the thrash ratio is above --thrash-threshold",
        value=int(thrashing),
    )
    yield GaugeMetricFamily(
        P + "admission_paused",
        "1 while thrash backpressure refuses new requests",
        value=int(slo.backpressure and thrashing),
    )
    yield CounterMetricFamily(
        P + "kv_thrash_episodes",
        "Times the thrash ratio crossed --thrash-threshold",
        value=thrash.num_episodes,
    )
    refused = CounterMetricFamily(
        P + "admission_refused",
        "Requests refused by SLO admission or thrash backpressure",
        labels=["reason"],
    )
    refused.add_metric(["ttft_slo"], slo.num_refused_slo)
    refused.add_metric(["thrash"], slo.num_refused_thrash)
    yield refused
