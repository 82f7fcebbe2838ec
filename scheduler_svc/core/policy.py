"""Scheduling policies: the ONE place that decides request order and preemption victims.

A policy gives the waiting queue its sort key (lower = served first) and picks the victim when a
running request needs KV blocks that are not there. New policies (sjf, fair share, deadline...)
subclass SchedulingPolicy and register themselves by name; schedule() never branches on names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from scheduler_svc.core.request import Request

_REGISTRY: dict[str, type[SchedulingPolicy]] = {}


class SchedulingPolicy:
    """Order of the waiting queue and choice of preemption victims.

    fifo: True means arrival order is the order (the queue is a deque and ``key`` is unused).
    key(request): sort key, smaller runs first; must not change while the request waits unless
        ``refresh`` says so (the queue then re-sorts).
    select_victim(running): index in ``running`` (admission order) of the request to preempt.
    refresh(now): aging hook, called once per step when ``aging`` is True; return True when keys
        changed so the queue re-sorts (O(waiting), so only when something really changed).
    """

    name: ClassVar[str] = ""
    fifo: ClassVar[bool] = False
    aging: ClassVar[bool] = False

    def key(self, request: Request) -> Any:
        return (request.arrival_time,)

    def select_victim(self, running: Sequence[Request]) -> int:
        """Default: the running request with the largest key (least important)."""
        key = self.key
        best = 0
        best_key = key(running[0])
        for i in range(1, len(running)):
            k = key(running[i])
            if k >= best_key:  # ties: the later-admitted one
                best, best_key = i, k
        return best

    def refresh(self, now: float) -> bool:
        return False


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator: make ``cls`` available as ``SchedulerConfig(policy=cls.name)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_policy(name: str) -> None:
    _REGISTRY.pop(name, None)


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def create_policy(name: str, **kwargs: Any) -> SchedulingPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of {', '.join(available_policies())}"
        ) from None
    return cls(**kwargs)


@register_policy
class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order; the victim is the most recently admitted."""

    name = "fcfs"
    fifo = True

    def select_victim(self, running: Sequence[Request]) -> int:
        return len(running) - 1


@register_policy
class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, then earlier ``arrival_time``; the victim has max of both."""

    name = "priority"

    def key(self, request: Request) -> tuple[int, float]:
        return (request.priority, request.arrival_time)  # type: ignore[return-value]
