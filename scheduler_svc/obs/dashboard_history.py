"""A short per-worker history of steps for the dashboard (an EngineObserver).

Per step: prefill and decode tokens (deltas of the scheduler's counters), running / waiting /
swapped requests, KV usage, preemptions in that step, and the step's round trip.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from scheduler_svc.obs.engine_observer import EngineObserver

if TYPE_CHECKING:
    from scheduler_svc.core import SchedulerOutput
    from scheduler_svc.engine.serving_engine import ServingEngine
    from scheduler_svc.engine.worker_session import StepReply, WorkerSession

HISTORY_STEPS = 240
SERIES = ("t", "prefill", "decode", "running", "waiting", "swapped", "kv", "preempted", "step_ms")


@dataclass(slots=True)
class WorkerHistory:
    steps: deque = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    last_prefill: int = 0
    last_decode: int = 0
    last_preemptions: int = 0
    total_tokens: int = 0
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (time, tokens)

    def tokens_per_s(self, now: float, window: float = 5.0) -> float:
        tokens = sum(n for t, n in self.recent if now - t <= window)
        return tokens / window


class DashboardHistory(EngineObserver):
    def __init__(self, engine: ServingEngine | None = None) -> None:
        self.engine = engine
        self.workers: dict[str, WorkerHistory] = {}
        self.t0 = time.monotonic()
        self.num_finished_by_reason: dict[str, int] = {}
        self.deadlines: dict[tuple[str, int], list[int]] = {}  # (tenant, priority) -> [met, of]
        self.met_times: deque = deque(maxlen=4096)  # when requests met their deadlines

    def bind(self, engine: ServingEngine) -> None:
        self.engine = engine

    def on_worker_attached(self, session: WorkerSession) -> None:
        self.workers[session.worker_id] = WorkerHistory()

    def on_worker_detached(self, session: WorkerSession, reason: str) -> None:
        self.workers.pop(session.worker_id, None)

    def on_request_finished(self, state) -> None:
        key = str(state.finish_reason)
        self.num_finished_by_reason[key] = self.num_finished_by_reason.get(key, 0) + 1
        deadline = getattr(state, "deadline", None)
        if deadline is not None:
            end = state.finish_time if state.finish_time is not None else time.monotonic()
            met = key not in ("error", "abort") and end <= deadline
            counts = self.deadlines.setdefault((state.tenant or "", state.priority), [0, 0])
            counts[0] += met
            counts[1] += 1
            if met:
                self.met_times.append(end)

    def goodput_per_s(self, now: float, window: float = 60.0) -> float:
        """Requests that met their deadlines per second over the last ``window`` seconds."""
        return sum(1 for t in self.met_times if t >= now - window) / window

    def on_step(
        self, session: WorkerSession, out: SchedulerOutput, reply: StepReply, step_s: float
    ) -> None:
        hist = self.workers.get(session.worker_id)
        if hist is None:
            hist = self.workers[session.worker_id] = WorkerHistory()
        stats = session.scheduler.stats()
        prefill = stats.num_prefill_tokens - hist.last_prefill
        decode = stats.num_decode_tokens - hist.last_decode
        preempted = stats.num_preemptions - hist.last_preemptions
        if prefill + decode != out.total_num_scheduled_tokens:  # counters not kept: split by out
            decode = sum(1 for n in out.num_scheduled_tokens.values() if n == 1)
            prefill = out.total_num_scheduled_tokens - decode
            preempted = len(out.preempted_req_ids)
        hist.last_prefill = stats.num_prefill_tokens
        hist.last_decode = stats.num_decode_tokens
        hist.last_preemptions = stats.num_preemptions
        now = time.monotonic()
        hist.total_tokens += prefill + decode
        hist.recent.append((now, prefill + decode))
        hist.steps.append(
            (
                round(now - self.t0, 3),
                prefill,
                decode,
                stats.num_running,
                stats.num_waiting,
                getattr(stats, "num_swapped", 0),
                round(stats.kv_usage, 4),
                max(0, preempted),
                round(step_s * 1000, 2),
            )
        )

    # ---- the dashboard's JSON -------------------------------------------------------------
    def snapshot(self) -> dict:
        engine = self.engine
        now = time.monotonic()
        workers = []
        if engine is not None:
            for session, stats in sorted(engine.worker_stats(), key=lambda x: x[0].worker_id):
                hist = self.workers.get(session.worker_id) or WorkerHistory()
                rows = list(hist.steps)
                series = {name: [r[i] for r in rows] for i, name in enumerate(SERIES)}
                workers.append(
                    {
                        "worker_id": session.worker_id,
                        "state": getattr(session, "state", "lost" if session.lost else "active"),
                        "address": session.registration.address,
                        "kernels": session.registration.kernels,
                        # LoRA: adapter slots and the adapters in them (least recently used first)
                        "max_loras": getattr(session, "max_loras", 0),
                        "resident_loras": sorted(getattr(session, "resident_loras", ())),
                        "num_running": stats.num_running,
                        "num_waiting": stats.num_waiting,
                        "num_swapped": getattr(stats, "num_swapped", 0),
                        "kv_usage": stats.kv_usage,
                        "num_used_blocks": stats.num_used_blocks,
                        "num_total_blocks": stats.num_total_blocks,
                        "num_cached_blocks": getattr(stats, "num_cached_blocks", 0),
                        "num_preemptions": stats.num_preemptions,
                        "num_steps": session.num_steps,
                        "prefix_cache_hit_rate": getattr(stats, "prefix_cache_hit_rate", 0.0),
                        # speculative decoding: draft tokens verified and kept (0 when off)
                        "spec_draft_tokens": getattr(stats, "num_spec_draft_tokens", 0),
                        "spec_accepted_tokens": getattr(stats, "num_spec_accepted_tokens", 0),
                        "tokens_per_s": round(hist.tokens_per_s(now), 1),
                        "history": series,
                    }
                )
        queued = getattr(engine, "num_waiting", None) if engine is not None else 0
        if queued is None:
            queued = len(getattr(engine, "unassigned", ()))
        return {
            "time": round(now - self.t0, 3),
            "model": engine.model_name if engine is not None else "",
            "policy": engine.config.scheduling_policy if engine is not None else "",
            "num_requests_in_flight": len(engine.requests) if engine is not None else 0,
            "num_queued": queued,
            "num_finished": getattr(engine, "num_finished", 0),
            "finished_by_reason": dict(self.num_finished_by_reason),
            "goodput_per_s": round(self.goodput_per_s(now), 3),
            "deadlines": [
                {"tenant": t, "priority": p, "met": met, "of": of, "rate": met / of}
                for (t, p), (met, of) in sorted(self.deadlines.items())
            ],
            "workers": workers,
        }
