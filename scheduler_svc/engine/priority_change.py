"""The service's side of scheduling policies at run time: changing the priority of a waiting
request (gRPC SetPriority, HTTP POST /v1/requests/{id}/priority). The engine builds its policy
from the configuration (engine.policy_options)."""

from __future__ import annotations

from typing import Any, Protocol

from common.outcomes import PRIORITY_RANGE, PriorityChangeError
from scheduler_svc.core import FIFORequestQueue, RequestStatus


class QueuesView(Protocol):
    """What set_priority reads of the engine (which calls it: no import back)."""

    requests: dict[str, Any]
    waiting: Any
    sessions: dict[str, Any]


def set_priority(engine: QueuesView, request_id: str, priority: int) -> None:
    """Give a waiting request a new priority and reorder its queue (the global one, or the
    short local queue of the worker it was handed to). A running or swapped-out request keeps
    its priority: FAILED_PRECONDITION; an unknown id: NOT_FOUND."""
    low, high = PRIORITY_RANGE
    if not low <= priority <= high:
        raise PriorityChangeError(
            "INVALID_ARGUMENT", f"priority {priority} is outside [{low}, {high}]"
        )
    state = engine.requests.get(request_id)
    if state is None:
        raise PriorityChangeError("NOT_FOUND", f"no request {request_id!r} is in flight")
    queue = None
    if request_id in engine.waiting:
        queue = engine.waiting
    else:
        session = engine.sessions.get(state.worker_id or "")
        if session is not None and request_id in session.scheduler.waiting:
            queue = session.scheduler.waiting
    if queue is None:
        raise PriorityChangeError(
            "FAILED_PRECONDITION",
            f"request {request_id!r} is no longer waiting (it is running or swapped out); "
            "only a waiting request's priority can change",
        )
    state.priority = priority
    if isinstance(queue, FIFORequestQueue):  # arrival order: the priority does not move it
        request = queue.get(request_id)
        if request is not None:
            request.priority = priority
        return
    request = queue.remove(request_id)
    assert request is not None
    request.priority = priority
    if request.status is RequestStatus.PREEMPTED:
        queue.prepend(request)  # keeps a preempted request's tie-break advantage
    else:
        queue.add(request)
