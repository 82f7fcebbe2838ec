"""Hooks the engine calls as requests and steps happen (metrics and the dashboard implement them).

The default does nothing, so the engine never depends on a metrics library.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.core import SchedulerOutput
    from scheduler_svc.in_flight import InFlightRequest
    from scheduler_svc.worker_session import StepReply, WorkerSession


class EngineObserver:
    def on_request_accepted(self, state: InFlightRequest) -> None:
        """A request passed validation and entered the engine."""

    def on_request_rejected(self, reason: str) -> None:
        """A request was refused before entering (reason: a short kind, e.g. 'invalid')."""

    def on_tokens(self, state: InFlightRequest, num_new: int, now: float) -> None:
        """num_new output tokens reached the request's stream at time.monotonic() `now`."""

    def on_tokens_batch(self, deliveries: list[tuple[InFlightRequest, int]], now: float) -> None:
        """One step's deliveries (request, number of new tokens), all at `now`. The engine
        calls this once per step rather than on_tokens per request; the default forwards each
        to on_tokens, an observer on the hot path overrides it."""
        on_tokens = self.on_tokens
        for state, num_new in deliveries:
            on_tokens(state, num_new, now)

    def on_request_finished(self, state: InFlightRequest) -> None:
        """The request ended (state.finish_reason says how; state.finish_time when)."""

    def on_step(
        self, session: WorkerSession, out: SchedulerOutput, reply: StepReply, step_s: float
    ) -> None:
        """A worker answered one step; step_s is the scheduler-side round trip."""

    def on_worker_attached(self, session: WorkerSession) -> None: ...

    def on_worker_detached(self, session: WorkerSession, reason: str) -> None: ...
