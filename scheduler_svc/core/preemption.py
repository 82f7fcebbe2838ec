"""Preemption: which running request loses its seat, what it gives back, where it goes.

When a running request's next blocks cannot be allocated, victims chosen by the policy are
preempted until it fits or it is the victim itself; a victim already scheduled this step gives
its tokens back. A victim is swapped (computed KV to host blocks, progress kept, into the
swapped queue) when the mode says so and the host has room, and recomputed otherwise (blocks
freed, progress reset, back to the head of waiting).
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler_svc.core.block_pool import KVCacheBlock
from scheduler_svc.core.draft_tracking import DraftTracker
from scheduler_svc.core.kv_cache_manager import KVCacheManager
from scheduler_svc.core.policy import SchedulingPolicy
from scheduler_svc.core.preemption_cost import PreemptionCostModel
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.stats import SchedulerCounters
from scheduler_svc.core.step_state import StepState
from scheduler_svc.core.worker_view import WorkerView


class Preemptor:
    def __init__(
        self,
        *,
        policy: SchedulingPolicy,
        cost: PreemptionCostModel,
        kv: KVCacheManager,
        running: list[Request],
        running_by_id: dict[str, Request],
        waiting: RequestQueue,
        swapped: RequestQueue,
        worker_view: WorkerView,
        drafts: DraftTracker,
        counters: SchedulerCounters,
    ) -> None:
        self.policy = policy
        self.cost = cost
        self.kv = kv
        self.running = running
        self.running_by_id = running_by_id
        self.waiting = waiting
        self.swapped = swapped
        self.worker_view = worker_view
        self.drafts = drafts
        self.counters = counters

    def make_room(
        self, req: Request, n: int, i: int, step: StepState
    ) -> tuple[Sequence[KVCacheBlock] | None, int]:
        """Preempt victims until ``req`` (at running[i]) gets its n slots. Returns its new
        blocks (None if it was preempted itself) and its index after the removals."""
        running = self.running
        while True:
            # DESIGN's rule (the least important, latest arrival) unless preemption is
            # cost-based ("auto"): then equally important candidates are ranked by wasted work
            waste = self.cost.waste if self.cost.mode == "auto" else None
            vi = self.policy.select_victim(running, waste)
            victim = running.pop(vi)
            if vi < i:  # already scheduled this step: give its tokens and its output back
                i -= 1
                self.give_back(victim, step)
            self.preempt(victim, step)
            if victim is req:
                return None, i
            new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is not None:
                return new_blocks, i

    def give_back(self, victim: Request, step: StepState) -> None:
        rid = victim.request_id
        n = step.num_scheduled.pop(rid, None)
        if n is None:
            return
        step.budget += n
        if n == 1 and victim.num_computed_tokens == victim.num_tokens and victim.output_token_ids:
            step.num_decode -= 1
        victim.num_computed_tokens -= n  # those tokens will not be computed in this step
        step.spec.pop(rid, None)
        self.kv.uncache_uncomputed(victim)  # nor will the blocks they would have filled
        self.worker_view.withdraw(rid, step)
        for j in range(len(step.reqs) - 1, -1, -1):
            if step.reqs[j] is victim:
                if step.samples[j]:
                    victim.num_output_placeholders -= 1
                del step.reqs[j]
                del step.ns[j]
                del step.samples[j]
                break

    def preempt(self, victim: Request, step: StepState) -> None:
        """Swap (its computed KV to host blocks, progress kept, into the swapped queue) when the
        mode says so and the host has room; otherwise recompute: free its blocks (full ones stay
        cached), reset progress, requeue at the head of waiting (keeping arrival and priority).
        The caller has taken it out of the running list."""
        rid = victim.request_id
        del self.running_by_id[rid]
        # unsent, it now returns the way any request does
        self.worker_view.adopted_unsent.discard(rid)
        victim.num_preemptions += 1
        self.counters.num_preemptions += 1
        step.preempted.add(rid)
        if (
            self.cost.mode != "recompute"
            and not self.drafts.in_flight_for(rid)  # its computed count includes unverified drafts
            and self.cost.prefers_swap(victim)
        ):
            pairs = self.kv.swap_out(victim)
            if pairs is not None:
                victim.status = RequestStatus.SWAPPED
                step.swap_out += pairs
                self.counters.num_swap_outs += 1
                self.swapped.prepend(victim)
                return
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        self.waiting.prepend(victim)
