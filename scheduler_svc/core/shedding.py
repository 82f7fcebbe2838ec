"""Requests the policy calls hopeless: they can no longer meet their targets (goodput).

Waiting ones are ended at once with FinishReason.SHED, as an abort would end them. Running ones
give up their seats, most expendable first, while a request that can still meet its targets
waits at the head of the queue without one: preempted as blocks running short would (recompute
or swap), so the policy's order puts them behind the feasible requests and aging bounds their
wait; with the policy's ``shed_hopeless`` ended instead, as the next step's shedding would end
them anyway.
"""

from __future__ import annotations

from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.policy import SchedulingPolicy
from scheduler_svc.core.preemption import Preemptor
from scheduler_svc.core.request import Request
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.stats import SchedulerCounters
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.waiting_admission import WaitingAdmitter
from scheduler_svc.core.worker_view import WorkerView


class Shedder:
    def __init__(
        self,
        *,
        policy: SchedulingPolicy,
        kv: KVCacheManager,
        running: list[Request],
        running_by_id: dict[str, Request],
        waiting: RequestQueue,
        worker_view: WorkerView,
        counters: SchedulerCounters,
        preemptor: Preemptor,
        admitter: WaitingAdmitter,
    ) -> None:
        self.policy = policy
        self.kv = kv
        self.running = running
        self.running_by_id = running_by_id
        self.waiting = waiting
        self.worker_view = worker_view
        self.counters = counters
        self.preemptor = preemptor
        self.admitter = admitter
        self.shed: list[Request] = []  # ended here, not yet taken by take_shed()

    def take_shed(self) -> list[Request]:
        shed, self.shed = self.shed, []
        return shed

    def shed_waiting(self) -> None:
        for req in self.policy.hopeless_waiting():
            if self.waiting.remove(req.request_id) is None:
                continue  # not in a queue this scheduler can take it from
            self._end(req)

    def unseat_running(self, step: StepState) -> None:
        policy = self.policy
        head = self.waiting.peek()
        has_seat = self.admitter.has_seat
        if head is None or not policy.wants_seat(head) or has_seat(head):
            return
        for victim in policy.hopeless_running(self.running):
            self.running.remove(victim)
            if policy.shed_hopeless:
                del self.running_by_id[victim.request_id]
                self.worker_view.adopted_unsent.discard(victim.request_id)
                self.kv.free(victim)
                self._end(victim)
            else:
                self.preemptor.preempt(victim, step)
            if has_seat(head):
                return

    def _end(self, req: Request) -> None:
        req.mark_shed(self.policy.missed_target(req))
        self.worker_view.end(req.request_id)
        self.counters.num_shed += 1
        self.shed.append(req)
