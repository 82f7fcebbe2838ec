"""Requests that come back to a scheduler already under way: a front-end's resumed requests
(after its link broke, or to a new leader), and a new leader's rebuild, which adopts the rows
and KV the workers still hold instead of recomputing them (docs/architecture.md, Failover)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.logging import get_logger
from scheduler_svc.engine.in_flight import InFlightRequest

if TYPE_CHECKING:
    from scheduler_svc.engine.engine_host import EngineHost

log = get_logger("splitserve.engine")


class Takeover:
    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    def resume(self, states: list[InFlightRequest]) -> int:
        """Requests a front-end had in flight when it (re)connected, with the tokens its
        clients already have: no admission checks (they were admitted once). During a takeover
        they wait for the rebuild; otherwise each continues on the KV its worker still holds
        or goes back to the head of the queue. Returns how many continue without recompute."""
        for state in states:  # the same request over an older link of this front-end
            self.engine.drop(state.request_id)
        states = [s for s in states if not self.engine._fail_impossible(s)]
        if self.engine.rebuilding:
            ids = {s.request_id for s in states}
            self.engine._resumed = [
                s for s in self.engine._resumed if s.request_id not in ids
            ] + states
            return 0
        return self.place_resumed(states)

    def begin_rebuild(self) -> None:
        self.engine.rebuilding = True

    def finish_rebuild(self) -> tuple[int, int, int]:
        """End of a takeover's rebuild: adopt what the workers hold, queue the rest.
        Returns (requests resumed, of which adopted without recompute, tokens to recompute)."""
        states, self.engine._resumed = self.engine._resumed, []
        adopted = self.place_resumed(states)
        recomputed = sum(
            len(s.prompt_token_ids) + len(s.output_token_ids)
            for s in states
            if s.worker_id is None and s.finish_reason is None
        )
        self.engine._held.clear()
        self.engine.rebuilding = False
        self.engine._dispatch()
        for session in self.engine.sessions.values():
            session.wakeup.set()
        return len(states), adopted, recomputed

    def place_resumed(self, states: list[InFlightRequest]) -> int:
        adopted = 0
        queued: list[InFlightRequest] = []
        for state in states:
            request = state.to_core_request()
            state.core = request
            self.engine.requests[state.request_id] = state
            self.engine.observer.on_request_accepted(state)
            if self.adopt(state, request):
                adopted += 1
            else:
                queued.append(state)
        queued.sort(key=lambda s: s.arrival_time, reverse=True)  # prepend: latest first
        for state in queued:
            assert state.core is not None
            self.engine.waiting.prepend(state.core)
            self.engine._await_worker(state)
        self.engine._dispatch()
        return adopted

    def adopt(self, state: InFlightRequest, request) -> bool:
        """Continue on the worker row that holds this request's KV (no recompute), when one
        reported it and its blocks fit the new leader's accounting."""
        session, row = self.engine._held.pop(state.request_id, (None, None))
        if session is None or row is None or session.lost or session.draining:
            return False
        num_computed = min(row.num_computed_tokens, request.num_tokens - 1)
        try:
            session.scheduler.adopt_request(request, list(row.block_ids), num_computed)
        except ValueError as exc:
            log.warning("adopt_refused", request_id=state.request_id, reason=str(exc))
            return False
        state.worker_id = session.worker_id
        session.request_ids.add(state.request_id)
        session.wakeup.set()
        return True
