"""Earliest deadline first, with requests that can no longer meet their deadline demoted.

``Request.deadline`` is the absolute time (on the policy's clock) by which the request should be
finished. A waiting request with a deadline it can still meet goes first, earliest deadline
first. One that cannot (its predicted remaining service, core/remaining_work.py: its tokens
left to compute and the output it is predicted to still produce, ends after the deadline) is
demoted: it joins the
requests without a deadline, served after every feasible one, oldest first (best effort, never
dropped). The check runs when a request is queued and, through ``refresh``, every step: the
policy keeps the instant each waiting request stops being feasible and bumps its generation
when one passes, so every queue ordered by it re-sorts once. The step costs are the
constructor's, the service's measured fit (``measured``) or, given neither, learned from the
steps on the policy's own clock (``StepClock``).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence

from scheduler_svc.core.policy import SchedulingPolicy, register_policy
from scheduler_svc.core.remaining_work import (
    OutputLengthPredictor,
    ServiceCosts,
    StepClock,
    StepFit,
    latency_s,
)
from scheduler_svc.core.request import Request, RequestStatus

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)


@register_policy
class DeadlinePolicy(SchedulingPolicy):
    name = "deadline"
    aging = True  # refresh() every step: demotions
    accounts = True  # account() tells which requests ran: the step time without a cost fit
    uses_step_costs = True

    def __init__(
        self, prefill_s_per_token: float | None = None, decode_s_per_token: float | None = None
    ) -> None:
        for label, v in (
            ("prefill_s_per_token", prefill_s_per_token),
            ("decode_s_per_token", decode_s_per_token),
        ):
            if v is not None and not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{label} must be a finite number >= 0; got {v!r}")
        self.steps = (
            StepClock() if prefill_s_per_token is None and decode_s_per_token is None else None
        )
        guess = ServiceCosts()  # until given or learned
        decode = guess.decode_s_per_token if decode_s_per_token is None else decode_s_per_token
        prefill = guess.prefill_s_per_token if prefill_s_per_token is None else prefill_s_per_token
        self.costs = ServiceCosts(prefill, decode, decode)
        self.predictor = OutputLengthPredictor()
        self._known: dict[str, Request] = {}  # seen by key(), learned from once finished
        self._expiry: list[tuple[float, int, Request]] = []  # (latest feasible start, seq, req)
        self._tracked: dict[str, float] = {}  # request id -> its live entry's time
        self._seq = itertools.count()
        self.num_demoted = 0

    @property
    def prefill_s_per_token(self) -> float:
        return self.costs.prefill_s_per_token

    def measured(self, fit: StepFit, batch: int, num_workers: int) -> None:
        if fit.usable:
            self.steps = None  # the service's fit wins over the policy's own
            self.costs = fit.service_costs(batch)

    def account(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        """Without a cost fit, the steps on the policy's clock teach it the step time."""
        steps = self.steps
        fit = None if steps is None else steps.step(self.clock(), requests, num_tokens)
        if steps is not None and fit is not None:
            self.costs = fit.service_costs(round(steps.batch))

    def time_left(self, request: Request) -> float:
        """The service the request still needs alone: its tokens left to compute at the
        prefill rate, then its predicted outputs left at one decode step each."""
        return latency_s(request, self.predictor.outputs_left(request), self.costs)

    def feasible(self, request: Request, now: float | None = None) -> bool:
        d = request.deadline
        if d is None:
            return False
        now = self.clock() if now is None else now
        return now + self.time_left(request) <= d

    def key(self, request: Request) -> tuple[int, float, float]:
        arrival = request.arrival_time
        d = request.deadline
        if d is None:
            return (1, arrival, arrival)
        rid = request.request_id
        if rid not in self._known:
            self._known[rid] = request
        latest = d - self.time_left(request)
        if self.clock() > latest:
            return (1, arrival, d)  # demoted: best effort, oldest first
        if self._tracked.get(rid) != latest:
            self._tracked[rid] = latest
            heapq.heappush(self._expiry, (latest, next(self._seq), request))
        return (0, d, arrival)

    def victim_key(self, request: Request) -> tuple[int, float]:
        """Requests without a (still meetable) deadline go first; then the latest deadline."""
        d = request.deadline
        if d is None or not self.feasible(request):
            return (1, 0.0)
        return (0, d)

    def _learn(self) -> None:
        """Finished requests teach the output-length predictor."""
        known = self._known
        for rid in [rid for rid, r in known.items() if r.status is RequestStatus.FINISHED]:
            self.predictor.observe(known.pop(rid))

    def refresh(self, now: float) -> bool:
        self._learn()
        heap, tracked = self._expiry, self._tracked
        changed = False
        while heap and heap[0][0] < now:
            latest, _, request = heapq.heappop(heap)
            rid = request.request_id
            if tracked.get(rid) != latest:
                continue  # superseded by a later key()
            del tracked[rid]
            if request.status in _WAITING:
                changed = True
                self.num_demoted += 1
        if changed:
            self.generation += 1
        return changed
