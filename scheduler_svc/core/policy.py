"""Scheduling policies: the ONE place that decides request order and preemption victims.

A policy gives the waiting queue its sort key (lower = served first) and picks the victim when a
running request needs KV blocks that are not there. Policies subclass SchedulingPolicy and
register themselves by name; schedule() never branches on names. fcfs and priority live here;
sjf, the aging variants, fair share and deadline in scheduler_svc/core/policies/, which imports
this module (never the reverse) and is imported by scheduler_svc/core/__init__.py, so every
built-in is registered once the core is imported.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from scheduler_svc.core.request import Request

if TYPE_CHECKING:
    from scheduler_svc.core.remaining_work import StepFit

_REGISTRY: dict[str, type[SchedulingPolicy]] = {}
# victims whose waste per freed block is within this fraction of the least count as equal: only
# a markedly cheaper victim wins over the latest arrival. Measured with `splitserve sim`: a strict
# least-waste rule preempts short decodes again and again (they come back at once and are the
# cheapest again), doubling preemptions and recomputed tokens against latest-arrival victims.
WASTE_TOLERANCE = 1.0


class SchedulingPolicy:
    """Order of the waiting queue and choice of preemption victims.

    fifo: True means arrival order is the order (the queue is a deque and ``key`` is unused).
    key(request): sort key, smaller runs first; must not change while the request waits unless
        the policy says so (``refresh`` returning True, or ``generation`` bumped: every queue
        ordered by this policy then re-sorts before its next peek/pop).
    victim_key(request): how expendable a running request is (larger = preempted first);
        default ``key``. select_victim breaks its ties by the least wasted work.
    select_victim(running, waste): index in ``running`` (admission order) of the request to
        preempt; ``waste(request)`` is what preempting it would cost (seconds or tokens).
    refresh(now): aging hook, called once per step when ``aging`` is True; return True when keys
        changed (O(waiting) re-sort, so only when something really changed).
    account(requests, num_tokens): called after each step when ``accounts`` is True, with the
        requests scheduled and their token counts (per-tenant service, fair share; the step
        time a policy without a cost fit learns on its clock).
    admits(request): False holds a waiting request back for this step (it keeps its place and
        admission goes on with the next); default True.
    hopeless_waiting(): waiting requests to end now (FinishReason.SHED) because they can no
        longer meet their targets; called once per step; default none (goodput's shed_hopeless).
    wants_seat(request): the waiting request can still meet its targets, so a running request
        that cannot may give up its seat to it (``Shedder.unseat_running``); default False.
    hopeless_running(running): the running requests that can no longer meet their targets and
        may lose their seat to one that wants it, most expendable first; default none.
    shed_hopeless: True ends such requests (FinishReason.SHED) instead of demoting them.
    missed_target(request): names the target a shed request can no longer meet ("deadline",
        "time-to-first-token target", "time-per-output-token target"); default "deadline".
    measured(fit, batch, num_workers): the workers' step time as measured and how many workers
        serve; a policy with a cost model (deadline, goodput) replaces its estimates; called
        after each step only when ``uses_step_costs`` is True.
    make_queue(): optional; a policy that needs its own queue structure returns it here.
    clock: the time source for time-dependent keys (the simulator sets a simulated clock).
    """

    name: ClassVar[str] = ""
    fifo: ClassVar[bool] = False
    aging: ClassVar[bool] = False
    accounts: ClassVar[bool] = False
    uses_step_costs: ClassVar[bool] = False  # measured() replaces its cost estimates

    clock: Callable[[], float] = staticmethod(time.monotonic)
    generation: int = 0  # bumped when keys of waiting requests change
    shed_hopeless: bool = False

    def key(self, request: Request) -> Any:
        return (request.arrival_time,)

    def victim_key(self, request: Request) -> Any:
        return self.key(request)

    def select_victim(
        self, running: Sequence[Request], waste: Callable[[Request], float] | None = None
    ) -> int:
        """Among the running requests with the largest victim_key (least important), the one
        whose preemption wastes least work for the KV memory it returns (``waste``: work lost
        per block freed; within WASTE_TOLERANCE of the least counts as equal); among those the
        latest arrival, then the later-admitted one."""
        vkey = self.victim_key
        keys = [vkey(r) for r in running]
        worst = max(keys)
        cands = [i for i, k in enumerate(keys) if k == worst]
        if waste is not None and len(cands) > 1:
            w = {i: waste(running[i]) for i in cands}
            bound = min(w.values()) * (1 + WASTE_TOLERANCE) + 1e-12
            cands = [i for i in cands if w[i] <= bound]
        return max(cands, key=lambda i: (running[i].arrival_time, i))

    def refresh(self, now: float) -> bool:
        return False

    def account(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        """Tokens just scheduled for these requests (only when ``accounts``)."""

    def admits(self, request: Request) -> bool:
        return True

    def hopeless_waiting(self) -> list[Request]:
        return []

    def wants_seat(self, request: Request) -> bool:
        return False

    def missed_target(self, request: Request) -> str:
        return "deadline"

    def hopeless_running(self, running: Sequence[Request]) -> list[Request]:
        return []

    def measured(self, fit: StepFit, batch: int, num_workers: int) -> None:
        """The service's measured step costs (see the class docstring)."""


def register_policy(cls: type[SchedulingPolicy]) -> type[SchedulingPolicy]:
    """Class decorator: make ``cls`` available as ``SchedulerConfig(policy=cls.name)``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute 'name'")
    _REGISTRY[cls.name] = cls
    return cls


def unregister_policy(name: str) -> None:
    _REGISTRY.pop(name, None)


def available_policies() -> list[str]:
    """Registered names, in registration order (the built-ins first)."""
    return list(_REGISTRY)


def create_policy(name: str, **options: Any) -> SchedulingPolicy:
    """A new policy by name. ``options`` the policy's constructor does not take are ignored
    (one option set serves every policy: aging_rate, weights, ...); None means default."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown scheduling policy {name!r}; choose one of {', '.join(available_policies())}"
        ) from None
    params = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    kwargs = {k: v for k, v in options.items() if v is not None and (takes_any or k in params)}
    return cls(**kwargs)


@register_policy
class FCFSPolicy(SchedulingPolicy):
    """First come, first served: arrival order; the victim is the most recently admitted
    (it has normally done the least work: vLLM's choice)."""

    name = "fcfs"
    fifo = True

    def select_victim(
        self, running: Sequence[Request], waste: Callable[[Request], float] | None = None
    ) -> int:
        return len(running) - 1


@register_policy
class PriorityPolicy(SchedulingPolicy):
    """Lower ``priority`` first, then earlier ``arrival_time``. The victim has the largest
    priority value; among equals the one whose loss wastes least work, then the latest."""

    name = "priority"

    # (float: the aging variant's first element is a priority plus an aging bonus)
    def key(self, request: Request) -> tuple[float, float]:
        return (request.priority, request.arrival_time)

    def victim_key(self, request: Request) -> tuple[int]:
        return (request.priority,)
