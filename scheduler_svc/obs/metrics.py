"""Prometheus metrics, names parallel to vLLM's with the `splitserve:` prefix.

Request-level counters and latency histograms are updated by the engine's observer hooks;
per-worker gauges and counters (running, waiting, KV usage, preemptions, prefix cache, ...) are
read from `engine.worker_stats()` at scrape time by WorkerCollector (worker_collector.py).
Everything lives in the observer's own CollectorRegistry (nothing global).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from scheduler_svc.core import FinishReason
from scheduler_svc.core.remaining_work import targets_met
from scheduler_svc.obs.engine_observer import EngineObserver
from scheduler_svc.obs.spec_metrics import SpecDecodeCollector
from scheduler_svc.obs.worker_collector import P, WorkerCollector

if TYPE_CHECKING:
    from scheduler_svc.core import SchedulerOutput
    from scheduler_svc.engine.in_flight import InFlightRequest
    from scheduler_svc.engine.serving_engine import ServingEngine
    from scheduler_svc.engine.worker_session import StepReply, WorkerSession

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
        self.lora_requests = Counter(
            P + "lora_requests_finished",
            "Finished requests of each LoRA adapter",
            ["lora_name"],
            registry=r,
        )
        self.lora_tokens = Counter(
            P + "lora_generation_tokens",
            "Output tokens of each LoRA adapter's finished requests",
            ["lora_name"],
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
        lora_name = getattr(state, "lora_name", "")
        if lora_name:
            self.lora_requests.labels(lora_name=lora_name).inc()
            self.lora_tokens.labels(lora_name=lora_name).inc(len(state.output_token_ids))
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
