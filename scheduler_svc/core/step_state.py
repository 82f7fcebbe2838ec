"""What one schedule() call has decided so far (shared by the scheduler's phases)."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.messages import CachedRequestData, NewRequestData
from scheduler_svc.core.request import Request

# steps scheduled and not yet applied that are remembered (async scheduling keeps two in flight):
# the outputs of older ones never came back
MAX_STEPS_IN_FLIGHT = 8


@dataclass(slots=True)
class StepState:
    """What one schedule() call has decided so far."""

    step_id: int
    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)
    num_decode: int = 0
    reqs: list[Request] = field(default_factory=list)  # scheduled, parallel to ns
    ns: list[int] = field(default_factory=list)
    samples: list[bool] = field(default_factory=list)  # parallel: does it sample this step
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    spec: dict[str, list[int]] = field(default_factory=dict)  # drafts to verify, by request
