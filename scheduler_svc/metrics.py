"""Prometheus metrics, names parallel to vLLM's with the `splitserve:` prefix.

Request-level counters and latency histograms are updated by the engine's observer hooks;
per-worker gauges and counters (running, waiting, KV usage, preemptions, prefix cache, ...) are
read from `engine.worker_stats()` at scrape time by a custom collector, labelled `worker`.
Everything lives in the observer's own CollectorRegistry (nothing global).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from scheduler_svc.core import FinishReason
from scheduler_svc.core.remaining_work import targets_met
from scheduler_svc.observer import EngineObserver
from scheduler_svc.spec_metrics import SpecDecodeCollector

if TYPE_CHECKING:
    from scheduler_svc.core import SchedulerOutput
    from scheduler_svc.engine import ServingEngine
    from scheduler_svc.in_flight import InFlightRequest
    from scheduler_svc.worker_session import StepReply, WorkerSession

P = "splitserve:"
MSP = "vllm:"  # the Model Server Protocol's names (model_server_metrics)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
STEP_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
TOKENS_PER_STEP_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class ObserverGroup(EngineObserver):
    """Fans every hook out to several observers (metrics and the dashboard's history).
    Hooks added to EngineObserver later are forwarded too. The fan-out functions are built
    once here: hooks run per token, on the step loop's hot path."""

    def __init__(self, *observers: EngineObserver) -> None:
        self.observers = observers
        for name in dir(EngineObserver):
            if name.startswith("on_"):
                hooks = [getattr(o, name) for o in observers if not _inert(o, name)]
                setattr(self, name, _fan_out(hooks))

    def __getattr__(self, name: str):  # a hook EngineObserver does not define (yet)
        if not name.startswith("on_"):
            raise AttributeError(name)
        hook = _fan_out([getattr(o, name) for o in self.__dict__["observers"]])
        setattr(self, name, hook)
        return hook


def _inert(observer: object, name: str) -> bool:
    """Whether the observer's hook is EngineObserver's own, which does nothing (on_tokens_batch
    there only forwards to on_tokens): such hooks are left out of the fan-out."""
    cls = type(observer)
    if cls.__getattribute__ is not object.__getattribute__ or name in getattr(
        observer, "__dict__", {}
    ):
        return False  # the hook may come from anywhere
    if getattr(cls, name, None) is not getattr(EngineObserver, name, None):
        return False  # overridden (or not an EngineObserver at all)
    return name != "on_tokens_batch" or _inert(observer, "on_tokens")


def _noop(*args, **kwargs) -> None:
    return None


def _fan_out(hooks: list):
    if not hooks:
        return _noop
    if len(hooks) == 1:
        return hooks[0]

    def call(*args, **kwargs) -> None:
        for hook in hooks:
            hook(*args, **kwargs)

    return call


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
        yield from model_server_metrics(
            getattr(engine, "model_name", ""),
            running,
            queued + waiting,
            used / total if total else 0.0,
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


def model_server_metrics(model: str, running: int, waiting: int, kv_usage: float) -> Iterable:
    """The Model Server Protocol's metrics, under vLLM's names: the Gateway API Inference
    Extension's endpoint picker and vLLM dashboards read these. The same numbers as the
    splitserve: families, for the whole scheduler: running and waiting summed over the workers
    (waiting includes the global queue), KV usage = used / total blocks of all workers. No LoRA:
    vllm:lora_requests_info says none is running, waiting or loadable (max_lora 0); its value is
    the time of the scrape, as vLLM's is the time of its last update. frontend_svc/observer.py
    emits the same names from the leader's status."""
    labels = ["model_name"]
    for name, doc, value in (
        ("num_requests_running", "Requests running on a worker", running),
        ("num_requests_waiting", "Requests waiting for a worker or in a worker's queue", waiting),
        ("kv_cache_usage_perc", "KV cache usage of all workers, 0..1 (1 = full)", kv_usage),
    ):
        family = GaugeMetricFamily(MSP + name, doc, labels=labels)
        family.add_metric([model], value)
        yield family
    lora = GaugeMetricFamily(
        MSP + "lora_requests_info",
        "LoRA adapters running and waiting (none: splitserve serves no LoRA adapters)",
        labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
    )
    lora.add_metric(["0", "", ""], time.time())
    yield lora


def slo_metrics(slo) -> Iterable:
    """Thrash backpressure and SLO admission (scheduler_svc/slo.py), read at scrape time."""
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


class MetricsObserver(EngineObserver):
    def __init__(self, engine: ServingEngine | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefilled prompt tokens", registry=r)
        self.generation_tokens = Counter(
            P + "generation_tokens", "Generated tokens delivered to clients", registry=r
        )
        self.request_success = Counter(
            P + "request_success",
            "Finished requests by finish reason",
            ["finished_reason"],
            registry=r,
        )
        self.request_rejected = Counter(
            P + "request_rejected",
            "Requests refused before entering the engine",
            ["reason"],
            registry=r,
        )
        self.ttft = Histogram(
            P + "time_to_first_token_seconds",
            "Time to first token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            P + "inter_token_latency_seconds",
            "Time between two deliveries of tokens",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            P + "time_per_output_token_seconds",
            "Mean time per output token after the first",
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            P + "e2e_request_latency_seconds",
            "Arrival to finish",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            P + "request_queue_time_seconds",
            "Arrival to first scheduled",
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.prompt_len = Histogram(
            P + "request_prompt_tokens",
            "Prompt length",
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=r,
        )
        self.output_len = Histogram(
            P + "request_generation_tokens",
            "Output length",
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=r,
        )
        self.step_time = Histogram(
            P + "step_time_seconds",
            "Scheduler-side round trip of one step",
            ["worker"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.forward_time = Histogram(
            P + "forward_time_seconds",
            "Worker's forward pass of one step",
            ["worker"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.step_tokens = Histogram(
            P + "step_scheduled_tokens",
            "Tokens scheduled in one step",
            ["worker"],
            buckets=TOKENS_PER_STEP_BUCKETS,
            registry=r,
        )
        lt = ["tenant", "priority"]
        self.deadline_requests = Counter(
            P + "deadline_requests",
            "Finished requests that had a deadline or a TTFT or TPOT target (shed and failed "
            "ones included)",
            lt,
            registry=r,
        )
        self.deadline_met = Counter(
            P + "deadline_met",
            "Requests that met their deadline and TTFT and TPOT targets (its rate is the goodput)",
            lt,
            registry=r,
        )
        self.deadline_met_ratio = Gauge(
            P + "deadline_met_ratio",
            "Fraction of the requests with targets that met them all, since the start",
            lt,
            registry=r,
        )
        self._deadline_counts: dict[tuple[str, str], list[int]] = {}  # labels -> [met, of]
        self.worker_events = Counter(
            P + "worker_events", "Workers attaching and detaching", ["event"], registry=r
        )
        for reason in FinishReason:  # every label value present from the start (at 0)
            self.request_success.labels(finished_reason=str(reason))
        self._not_scheduled: dict[str, float] = {}  # request id -> arrival, until first step
        self._last_delivery: dict[str, float] = {}
        if engine is not None:
            self.bind(engine)

    def bind(self, engine: ServingEngine) -> None:
        self.registry.register(WorkerCollector(engine))
        self.registry.register(SpecDecodeCollector(engine))

    # ---- hooks ----------------------------------------------------------------------------
    def on_request_accepted(self, state: InFlightRequest) -> None:
        self._not_scheduled[state.request_id] = state.arrival_time

    def on_request_rejected(self, reason: str) -> None:
        self.request_rejected.labels(reason=reason).inc()

    def on_step(
        self, session: WorkerSession, out: SchedulerOutput, reply: StepReply, step_s: float
    ) -> None:
        worker = session.worker_id
        self.step_time.labels(worker=worker).observe(step_s)
        self.forward_time.labels(worker=worker).observe(reply.forward_time_s)
        self.step_tokens.labels(worker=worker).observe(out.total_num_scheduled_tokens)
        if self._not_scheduled and out.new_requests:
            scheduled_at = time.monotonic() - step_s
            for new in out.new_requests:
                arrival = self._not_scheduled.pop(new.request_id, None)
                if arrival is not None:
                    self.queue_time.observe(max(0.0, scheduled_at - arrival))

    def on_tokens_batch(self, deliveries: list[tuple[InFlightRequest, int]], now: float) -> None:
        """The same counts as on_tokens for each delivery, with one counter update per step
        and one histogram update per distinct inter-token latency (a worker's requests mostly
        share their previous delivery time: the previous step)."""
        last = self._last_delivery
        total = 0
        gaps: dict[float, int] = {}  # previous delivery time -> deliveries since it
        for state, num_new in deliveries:
            total += num_new
            request_id = state.request_id
            previous = last.get(request_id)
            last[request_id] = now
            if previous is not None:
                gaps[previous] = gaps.get(previous, 0) + 1
            elif len(state.output_token_ids) == num_new:  # the very first tokens
                self.ttft.observe(now - state.arrival_time)
                self.prompt_tokens.inc(len(state.prompt_token_ids))
        if total:
            self.generation_tokens.inc(total)
        for previous, count in gaps.items():
            observe_many(self.itl, now - previous, count)

    def on_tokens(self, state: InFlightRequest, num_new: int, now: float) -> None:
        self.generation_tokens.inc(num_new)
        request_id = state.request_id
        previous = self._last_delivery.get(request_id)
        self._last_delivery[request_id] = now
        if previous is not None:
            self.itl.observe(now - previous)
        elif len(state.output_token_ids) == num_new:  # the very first tokens (not a migration)
            self.ttft.observe(now - state.arrival_time)
            self.prompt_tokens.inc(len(state.prompt_token_ids))

    def on_request_finished(self, state: InFlightRequest) -> None:
        request_id = state.request_id
        self._not_scheduled.pop(request_id, None)
        self._last_delivery.pop(request_id, None)
        reason = state.finish_reason
        self.request_success.labels(finished_reason=str(reason)).inc()
        end = state.finish_time if state.finish_time is not None else time.monotonic()
        deadline = getattr(state, "deadline", None)
        ttft, tpot = getattr(state, "ttft_target_s", None), getattr(state, "tpot_target_s", None)
        if deadline is not None or ttft is not None or tpot is not None:
            met = reason is not FinishReason.ERROR and targets_met(
                arrival=state.arrival_time,
                first_token=state.first_token_time,
                finish=end,
                num_outputs=len(state.output_token_ids),
                deadline=deadline,
                ttft_target_s=ttft,
                tpot_target_s=tpot,
            )
            self._count_deadline(state, met)
        if reason is FinishReason.ERROR:
            return
        self.e2e.observe(max(0.0, end - state.arrival_time))
        self.prompt_len.observe(len(state.prompt_token_ids))
        n = len(state.output_token_ids)
        self.output_len.observe(n)
        first, last = state.first_token_time, state.last_token_time
        if n > 1 and first is not None and last is not None:
            self.tpot.observe((last - first) / (n - 1))

    def _count_deadline(self, state: InFlightRequest, met: bool) -> None:
        labels = (state.tenant or "", str(state.priority))
        counts = self._deadline_counts.setdefault(labels, [0, 0])
        counts[0] += met
        counts[1] += 1
        self.deadline_requests.labels(*labels).inc()
        if met:
            self.deadline_met.labels(*labels).inc()
        self.deadline_met_ratio.labels(*labels).set(counts[0] / counts[1])

    def deadline_met_rates(self) -> dict[tuple[str, str], tuple[int, int]]:
        """(tenant, priority) -> (met, finished with a deadline), for the dashboard."""
        return {k: (v[0], v[1]) for k, v in self._deadline_counts.items()}

    def on_worker_attached(self, session: WorkerSession) -> None:
        self.worker_events.labels(event="attached").inc()

    def on_worker_detached(self, session: WorkerSession, reason: str) -> None:
        self.worker_events.labels(event="detached").inc()
        for family in (self.step_time, self.forward_time, self.step_tokens):
            try:
                family.remove(session.worker_id)
            except KeyError:
                pass


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`histogram.observe(value)` `count` times, in one update of its sum and bucket."""
    if count == 1:
        histogram.observe(value)
        return
    try:  # prometheus_client's Histogram keeps per-bucket (not cumulative) counts
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # pragma: no cover - another prometheus_client layout
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect_left(bounds, value)].inc(count)
