"""LoRA adapter slots: which adapters one worker's step may hold, and who waits for a slot.

A worker holds at most ``max_loras`` adapters at once (the base model, ``lora_name == ""``,
takes no slot). The adapters of all RUNNING requests count, not only those scheduled in a step:
a running request keeps its adapter in its slot until it ends or is preempted. So a waiting or
swapped request whose adapter is not among the running ones while they already number
``max_loras`` has no slot: it is skipped this step and keeps its place; requests behind it with
a running adapter, a free slot or no adapter go on (its reason not to run is its own).

Nothing starves: a request skipped for want of a slot counts the steps it was skipped
(``Request.lora_skipped_steps``, reset when admitted). Once that count passes
``lora_starvation_steps`` it is starving, and for the rest of the step requests behind it
(in admission order: swapped first, then waiting) are admitted only with its adapter or with
none. The running adapters then drain as their requests finish, a slot frees, and it gets in;
then the other adapters' requests wait and count in turn. The first starving request met in
a step sets the rule for that step (one adapter at a time: the oldest wait goes first).

Everything here is skipped for base-model requests: the admission loops only look at a
request's ``lora_name``, and a step's slot set is built the first time an adapter request is met.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Container, Iterable

from scheduler_svc.core.errors import RequestRejected
from scheduler_svc.core.request import Request

__all__ = ["AdapterBook", "StepAdapterSlots", "check_adapter", "has_slot", "running_adapters"]


def check_adapter(request: Request, max_loras: int) -> None:
    """Reject (RequestRejected) a request naming an adapter where no adapter can ever run."""
    name = request.lora_name
    if not isinstance(name, str):
        raise RequestRejected(f"lora_name must be a string; got {name!r}")
    if name and not max_loras:
        raise RequestRejected(
            f"request {request.request_id!r} asks for LoRA adapter {name!r} but this worker "
            "runs no adapters (max_loras 0); send it without one or to a worker with LoRA"
        )


def running_adapters(running: Iterable[Request]) -> set[str]:
    return {r.lora_name for r in running if r.lora_name}


def has_slot(request: Request, running: Iterable[Request], max_loras: int) -> bool:
    """Whether ``request``'s adapter would find a slot beside the running requests' now."""
    name = request.lora_name
    if not name:
        return True
    active = running_adapters(running)
    return name in active or len(active) < max_loras


class StepAdapterSlots:
    """One step's admissions as they take adapter slots, and the starving adapter, if any."""

    __slots__ = ("step_id", "max_loras", "starvation_steps", "running", "active", "starving")

    def __init__(
        self, step_id: int, max_loras: int, starvation_steps: int, running: list[Request]
    ) -> None:
        self.step_id = step_id
        self.max_loras = max_loras
        self.starvation_steps = starvation_steps
        self.running = running  # the scheduler's list: admitted requests join it
        self.active: set[str] | None = None  # running adapters, built when first needed
        self.starving = ""  # the adapter of the first starving request met this step

    def admits(self, request: Request) -> bool:
        """May ``request`` (one with an adapter) be admitted now? A request refused for want of
        a slot counts the step and may become the starving one."""
        name = request.lora_name
        active = self.active
        if active is None:
            active = self.active = running_adapters(self.running)
        if name not in active and len(active) >= self.max_loras:
            request.lora_skipped_steps += 1
            if not self.starving and request.lora_skipped_steps > self.starvation_steps:
                self.starving = name
            return False
        return not self.starving or name == self.starving

    def took(self, request: Request) -> None:
        """``request`` was admitted (it is in running now)."""
        request.lora_skipped_steps = 0
        if self.active is not None and request.lora_name:
            self.active.add(request.lora_name)


class AdapterBook:
    """The requests with an adapter this scheduler has seen, for stats(): only they are looked
    at, so a scheduler serving the base model alone pays nothing. Entries that ended or moved
    to another scheduler (a shared queue) drop out when counted."""

    __slots__ = ("requests",)

    def __init__(self) -> None:
        self.requests: dict[str, Request] = {}

    def note(self, request: Request, num_unfinished: int) -> None:
        """``request`` was added here or admitted here (noted if it has an adapter)."""
        if not request.lora_name:
            return
        requests = self.requests
        requests[request.request_id] = request
        if len(requests) > 2 * num_unfinished + 64:  # stats() may never come: stay bounded
            for rid in [rid for rid, r in requests.items() if r.is_finished()]:
                del requests[rid]

    def counts(
        self,
        running: dict[str, Request],
        waiting: Container[str],
        swapped: Container[str],
    ) -> tuple[dict[str, int], dict[str, int]]:
        """Requests per adapter: running here, and waiting here (queued or swapped out)."""
        num_running: Counter[str] = Counter()
        num_waiting: Counter[str] = Counter()
        gone = []
        for rid, req in self.requests.items():
            if running.get(rid) is req:
                num_running[req.lora_name] += 1
            elif not req.is_finished() and (rid in waiting or rid in swapped):
                num_waiting[req.lora_name] += 1
            else:
                gone.append(rid)
        for rid in gone:
            del self.requests[rid]
        return dict(num_running), dict(num_waiting)
