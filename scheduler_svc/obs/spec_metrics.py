"""Speculative decoding's Prometheus metrics, named as vLLM names them (with the `splitserve:`
prefix): verifications, drafted and accepted tokens, accepted tokens per draft position, per
worker. Read from each worker's core scheduler stats when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from scheduler_svc.obs.worker_collector import P

if TYPE_CHECKING:
    from scheduler_svc.engine.serving_engine import ServingEngine


class SpecDecodeCollector(Collector):
    def __init__(self, engine: ServingEngine) -> None:
        self.engine = engine

    def collect(self) -> Iterable:
        lw = ["worker"]
        drafts = CounterMetricFamily(
            P + "spec_decode_num_drafts", "Requests x steps that verified drafts", labels=lw
        )
        draft_tokens = CounterMetricFamily(
            P + "spec_decode_num_draft_tokens", "Draft tokens sent to be verified", labels=lw
        )
        accepted = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens", "Draft tokens verification kept", labels=lw
        )
        draft_time = CounterMetricFamily(
            P + "spec_decode_draft_seconds", "Seconds the scheduler spent drafting", labels=lw
        )
        per_pos = CounterMetricFamily(
            P + "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens kept at each draft position (0: the first draft)",
            labels=["worker", "position"],
        )
        for session, stats in self.engine.worker_stats():
            if session.lost:
                continue
            w = [session.worker_id]
            drafts.add_metric(w, stats.num_spec_drafts)
            draft_tokens.add_metric(w, stats.num_spec_draft_tokens)
            accepted.add_metric(w, stats.num_spec_accepted_tokens)
            draft_time.add_metric(w, stats.spec_draft_time_s)
            for position, count in enumerate(stats.spec_accepted_per_pos):
                per_pos.add_metric([session.worker_id, str(position)], count)
        yield from (drafts, draft_tokens, accepted, draft_time, per_pos)
