"""Shortest-job-first and the aging variants of sjf and priority.

Aging is linear: a request's rank improves by ``aging_rate`` per second it has waited, i.e. its
effective rank is ``base - aging_rate * (now - arrival)``. Every waiting request ages at the
same rate, so ``now`` drops out of any comparison and ``base + aging_rate * arrival`` orders the
queue exactly, at every moment: the key never changes while a request waits and the queue never
needs re-sorting. A request with base B is overtaken only by requests arriving less than
(B - b) / aging_rate seconds after it (b: their base), which bounds its wait.
"""

from __future__ import annotations

import math

from scheduler_svc.core.policy import PriorityPolicy, SchedulingPolicy, register_policy
from scheduler_svc.core.request import Request


def _rate(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"aging_rate must be a finite number > 0 ({what}); got {value!r}")
    if value <= 0:
        raise ValueError(f"aging_rate must be > 0 ({what}); got {value!r}")
    return float(value)


def remaining_tokens(request: Request) -> int:
    """Tokens a waiting request must compute before it samples: its prompt (a preempted one
    also its output, which it recomputes; a swapped one only what it had not computed)."""
    return request.num_tokens - request.num_computed_tokens


def remaining_prompt(request: Request) -> int:
    return max(0, request.num_prompt_tokens - request.num_computed_tokens)


@register_policy
class SJFPolicy(SchedulingPolicy):
    """Shortest remaining prompt first, then arrival. The victim is the running request with
    the most prompt left to prefill; among equals (decodes), the one whose loss wastes least."""

    name = "sjf"

    def key(self, request: Request) -> tuple[float, float]:
        return (remaining_tokens(request), request.arrival_time)

    def victim_key(self, request: Request) -> tuple[int]:
        return (remaining_prompt(request),)


@register_policy
class SJFAgingPolicy(SJFPolicy):
    """sjf where each second of waiting counts as ``aging_rate`` fewer prompt tokens."""

    name = "sjf-aging"

    def __init__(self, aging_rate: float = 100.0) -> None:
        self.aging_rate = _rate(aging_rate, "prompt tokens per second waited")

    def key(self, request: Request) -> tuple[float, float]:
        arrival = request.arrival_time
        return (remaining_tokens(request) + self.aging_rate * arrival, arrival)


@register_policy
class PriorityAgingPolicy(PriorityPolicy):
    """priority where each second of waiting counts as ``aging_rate`` priority levels (lower =
    sooner). Victims compare by their plain priority (then least waste, then latest)."""

    name = "priority-aging"

    def __init__(self, aging_rate: float = 0.1) -> None:
        self.aging_rate = _rate(aging_rate, "priority levels per second waited")

    def key(self, request: Request) -> tuple[float, float]:
        arrival = request.arrival_time
        return (request.priority + self.aging_rate * arrival, arrival)
