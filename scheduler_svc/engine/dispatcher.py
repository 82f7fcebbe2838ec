"""Which worker each request goes to, and when: the head of the global queue is handed out
just in time, to workers (local, or on a step shard) whose local queue has room, chosen by the
rows they hold for it, by cached prefix and load (placement.py); a request that outranks one
waiting in a full local queue goes ahead of it. A request with a LoRA adapter goes only to a
worker that runs adapters: while those are full it keeps its place and the requests behind it
go on; where no worker runs adapters it fails with a sentence. On a step shard, the leader's
placements land here (place)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.logging import get_logger
from scheduler_svc.core import Request, RequestRejected
from scheduler_svc.engine import placement
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.worker_session import WorkerSession
from scheduler_svc.shards.remote_worker import RemoteWorker

if TYPE_CHECKING:
    from scheduler_svc.engine.engine_host import EngineHost

log = get_logger("splitserve.engine")
PRIORITY_POLICIES = ("priority", "priority-aging")  # the ones that order by request.priority
# adapter requests one dispatch passes over while their workers are full (bounds its work)
MAX_ADAPTER_SKIPS = 64


class Dispatcher:
    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    def dispatch(self) -> None:
        """Hand requests from the head of the global queue to workers with room."""
        engine = self.engine
        if engine.rebuilding:
            return
        depth = engine.config.worker_queue_depth
        skipped: list[Request] = []  # adapter requests whose workers are all full
        while engine.waiting and len(skipped) < MAX_ADAPTER_SKIPS:
            targets = (*engine.sessions.values(), *engine.remote_workers.values())
            eligible: list[WorkerSession | RemoteWorker] = [
                # each within its own rows (the smaller of ours and the worker's)
                s
                for s in targets
                if s.accepting and s.num_local_waiting < depth and s.load < s.max_num_seqs + depth
            ]
            if not eligible:
                eligible = self._ahead_of_lower_priority(targets, depth)
                if not eligible:
                    break
            request = engine.waiting.pop()
            state = engine.requests[request.request_id]
            holder = next((s for s in eligible if request.request_id in s.held_request_ids), None)
            if holder is not None:  # its rows are there: it continues on them
                choice = placement.Placement(holder, "held", 0, holder.load)
            else:
                if request.lora_name:
                    eligible = [s for s in eligible if placement.runs_adapter(s, request)]
                    if not eligible:
                        if any(s.accepting and placement.runs_adapter(s, request) for s in targets):
                            skipped.append(request)
                        else:
                            self._reject_adapter(state, request)
                        continue
                choice = placement.choose(request, eligible, engine.placement)
            self.assign(state, request, choice)
        for request in reversed(skipped):
            engine.waiting.prepend(request)

    def _reject_adapter(self, state: InFlightRequest, request: Request) -> None:
        state.fail(
            f"request {request.request_id!r} asks for LoRA adapter {request.lora_name!r} but no "
            "worker runs LoRA adapters (start workers with adapter slots, or send it without one)",
            code="INVALID_ARGUMENT",
        )
        self.engine._end(state)

    def _ahead_of_lower_priority(
        self, targets: tuple[WorkerSession | RemoteWorker, ...], depth: int
    ) -> list[WorkerSession | RemoteWorker]:
        """Every local queue is full, but the head of the global one outranks a request waiting
        in one of them: it goes there (up to twice the depth), ahead of that one, instead of
        waiting until the lower one is admitted (priority inversion across workers)."""
        engine = self.engine
        if engine.policy.name not in PRIORITY_POLICIES:
            return []
        head = engine.waiting.peek()
        if head is None:
            return []
        behind = [
            s
            for s in targets
            if s.accepting
            and s.load < s.max_num_seqs + 2 * depth
            and (worst := s.worst_waiting_priority) is not None
            and worst > head.priority
        ]
        if not behind:
            return []
        return [max(behind, key=lambda s: s.worst_waiting_priority or 0)]

    def place(self, state: InFlightRequest, worker_id: str) -> bool:
        """On a step shard: run a request the leader placed on this worker. False when the
        worker is gone or leaving (the leader puts it back in its queue)."""
        engine = self.engine
        session = engine.sessions.get(worker_id)
        if session is None or not session.accepting or state.request_id in engine.requests:
            return False
        request = state.to_core_request()
        state.core = request
        engine.requests[state.request_id] = state
        held = engine._held.get(state.request_id)
        if held is not None and held[0] is session and engine.takeover.adopt(state, request):
            log.info("request_adopted", request_id=state.request_id, worker_id=worker_id)
            return True
        self.assign(state, request, placement.Placement(session, "leader", 0, session.load))
        return True

    def assign(self, state: InFlightRequest, request: Request, choice: placement.Placement) -> None:
        engine = self.engine
        session = choice.session
        try:
            state.inflight_hashes = session.take(state, request)
        except RequestRejected as exc:
            state.fail(str(exc), code="INVALID_ARGUMENT")
            engine._end(state)
            return
        engine._cancel_wait_timer(state)
        state.worker_id = session.worker_id
        session.request_ids.add(state.request_id)
        placement.add_inflight(session, state.inflight_hashes)
        if state.lora_name:
            session.placed_loras[state.lora_name] += 1
        log.info(
            "request_placed",
            request_id=state.request_id,
            worker_id=session.worker_id,
            reason=choice.reason,
            prefix_tokens=choice.prefix_tokens,
            load=choice.load,
            migrations=state.num_migrations,
        )
