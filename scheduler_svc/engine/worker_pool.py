"""The engine's workers: attach one (its own core Scheduler within the limits both sides
allow), detach a lost one and drain a leaving one, handing their requests back to the global
queue in order. The engine's request side and this pool share the engine's state."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from common.logging import get_logger
from scheduler_svc.core import Scheduler, create_request_queue
from scheduler_svc.engine import worker_limits
from scheduler_svc.engine.worker_session import WorkerRegistration, WorkerSession, WorkerTransport

if TYPE_CHECKING:
    from scheduler_svc.engine.engine_host import EngineHost

log = get_logger("splitserve.engine")


class WorkerPool:
    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    def attach(self, registration: WorkerRegistration, transport: WorkerTransport) -> WorkerSession:
        old = self.engine.sessions.get(registration.worker_id)
        if old is not None:
            self.detach(old, "replaced by a new connection with the same worker id")
        sched_cfg = worker_limits.scheduler_config(
            self.engine.config, registration, self.engine._speculative
        )
        # every worker's local queue orders with the engine's policy object, so policy state
        # (aging, per-tenant service) is global
        local_queue = create_request_queue(self.engine.policy)
        session = WorkerSession(registration, Scheduler(sched_cfg, local_queue), transport)
        session.resident_loras = set(registration.resident_loras)
        self.engine.sessions[registration.worker_id] = session
        self.engine.loras.worker_attached(session, registration.loras)
        if self.engine.rebuilding or self.engine.keeps_held_rows:
            for row in getattr(registration, "held", ()):
                self.engine._held[row.request_id] = (session, row)
        self.engine.worker_attached.set()
        for state in self.engine.requests.values():  # a worker takes them now: none waits for one
            self.engine._cancel_wait_timer(state)
        self.engine.observer.on_worker_attached(session)
        log.info(
            "worker_attached",
            worker_id=registration.worker_id,
            num_blocks=registration.num_device_blocks,
            block_size=registration.block_size,
            address=registration.address,
        )
        self.engine._dispatch()
        return session

    def detach(self, session: WorkerSession, reason: str) -> None:
        """The worker is gone: its unfinished requests go back to the global queue. Once per
        session: a worker that registers again under its id (restarted by `splitserve up`)
        while its old link still looks open replaces the old session here in `attach`, and the
        old link's end must not then detach the new session's metrics and history."""
        session.mark_lost(reason)
        if self.engine.sessions.get(session.worker_id) is not session:
            return
        del self.engine.sessions[session.worker_id]
        self.engine.loras.worker_detached(session)
        if not self.engine._live_sessions():
            self.engine.worker_attached.clear()
        moved = self.hand_back(session, session.request_ids, reason)
        self.engine._await_workers()
        self.engine.observer.on_worker_detached(session, reason)
        log.warning("worker_detached", worker_id=session.worker_id, reason=reason, migrated=moved)
        self.engine._dispatch()

    def hand_back(self, session: WorkerSession, request_ids, reason: str) -> int:
        """Move these requests of `session` back to the head of the global queue, keeping
        their relative order (the first to run goes first)."""
        states = [self.engine.requests[r] for r in request_ids if r in self.engine.requests]
        states.sort(key=lambda s: s.arrival_time, reverse=True)  # prepend: latest first
        for state in states:
            self.engine._leave_session(state)
            if not session.lost:
                session.scheduler.abort_request(state.request_id)
            self.engine._requeue(state, reason)
        return len(states)

    def start_drain(self, session: WorkerSession, timeout_s: float) -> None:
        """The worker is leaving: no new requests; local waiting ones go elsewhere now, running
        ones get until the deadline to finish."""
        if session.draining or session.lost:
            return
        session.draining = True
        session.drain_deadline = time.monotonic() + max(0.0, timeout_s)
        waiting_ids = [r.request_id for r in session.scheduler.waiting]
        moved = self.hand_back(session, waiting_ids, "worker draining")
        self.engine._await_workers()
        log.info(
            "worker_draining",
            worker_id=session.worker_id,
            timeout_s=timeout_s,
            running=session.load,
            handed_back=moved,
        )
        session.wakeup.set()
        self.engine._dispatch()

    def finish_drain(self, session: WorkerSession) -> int:
        """At the deadline (or when empty): hand back whatever still runs. Returns how many."""
        moved = self.hand_back(session, list(session.request_ids), "worker drain deadline")
        self.engine._dispatch()
        return moved
