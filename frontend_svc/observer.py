"""The front-end's own metrics: what its clients saw (the leader's /metrics has the rest)."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


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
