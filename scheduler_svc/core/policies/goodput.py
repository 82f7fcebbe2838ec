"""Goodput: serve so that as many requests as possible finish within their targets.

A request's targets are a deadline, a TTFT target, a TPOT target or several;
``remaining_work.due`` folds the first two into the time its remaining work is due, which is what
"deadline" means below. A TPOT target is met by the batch, not the order: a request is hopeless
when one decode step alone is slower than its target, and admission keeps every batch's step
within the TPOT targets of the requests in it.

Every step (``refresh``) the policy re-plans over the requests it knows, waiting and running,
with their predicted remaining work (core/remaining_work.py). Its step costs start as the
constructor's and, in the service, follow the workers' measured step time and the number of
live workers (``measured``, called by the engine after every step). Given neither costs nor a
measured fit, it learns the step time from the steps it sees on its own clock (``StepClock``)
until the service gives one:

- **hopeless**: even alone it would finish after its deadline. It can no longer count.
- **the feasible set**: the others in earliest-deadline order, each adding its worker time
  (shared by ``num_workers``); when one would finish late, the waiting request with the most
  work so far is rejected, the one whose removal gives the most time back (Moore and Hodgson's
  rule, which maximises the number of jobs on time on one machine). Running requests are
  committed: they are in the batch, their work is under way, and they are never rejected.
- **rejected** and hopeless requests are demoted behind the feasible set, with the requests
  that have no deadline, oldest first (best effort), and are not admitted while any request of
  the feasible set is unfinished (``admits``): on a batching worker admission, not order, is
  what decides who is served, and every request added to a batch slows all of its steps.
- **the batch**: a feasible request is admitted only if, with the batch one larger (a decode
  step costs ``decode_s_per_token`` plus ``decode_s_per_seq`` per other request on its
  worker), it still makes its deadline and no running request that would make its own misses
  it because of the newcomer's prefill and the slower steps (a TTFT target is checked on the
  first token there, not folded: the fold assumes steps as fast as alone). A
  request that has waited ``max_wait_s`` joins the feasible set's order as if due then and is
  admitted, so nothing waits much longer than that.
- **not overloaded**: while the plan rejects and gives up no request with a deadline, a
  request with only TTFT/TPOT targets is admitted without the checks above, in the plan's
  earliest-deadline order, as the deadline policy would (the batch gate and the first-token
  plan held such requests back at low load and met fewer of them than FCFS).
- ``shed_hopeless``: hopeless requests still waiting are ended at once instead
  (FinishReason.SHED), so their clients hear early: in a worker's queue by
  ``Shedder.shed_waiting`` (shedding.py), in the service's global queue by the engine.
- **seats**: when a feasible (or aged) request waits without a seat and a running request is
  hopeless, the running one gives its seat up (``wants_seat``, ``hopeless_running``,
  ``Shedder.unseat_running``): preempted and demoted, or with ``shed_hopeless`` ended.

Victims of preemption: first a request outside the feasible set (its loss costs no met
deadline), then one that would still make its deadline after recomputing (most slack first),
last one that would miss it.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler_svc.core.policy import SchedulingPolicy, register_policy
from scheduler_svc.core.remaining_work import (
    OutputLengthPredictor,
    ServiceCosts,
    StepClock,
    StepFit,
    due,
    has_targets,
    latency_s,
    missed_target,
    tokens_to_compute,
    work_s,
)
from scheduler_svc.core.request import Request, RequestStatus

_WAITING = (RequestStatus.WAITING, RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
_FEASIBLE, _DEMOTED = 0, 1


@dataclass(slots=True)
class GoodputPlan:
    """The last re-plan: request ids in the feasible set, rejected from it, hopeless, aged."""

    feasible: frozenset[str] = frozenset()
    rejected: frozenset[str] = frozenset()
    hopeless: frozenset[str] = frozenset()
    aged: frozenset[str] = frozenset()

    def standing(self, request_id: str) -> int:
        """0 aged, 1 feasible, 2 rejected or hopeless, 3 not planned yet."""
        if request_id in self.aged:
            return 0
        if request_id in self.feasible:
            return 1
        if request_id in self.rejected or request_id in self.hopeless:
            return 2
        return 3


@register_policy
class GoodputPolicy(SchedulingPolicy):
    name = "goodput"
    aging = True  # refresh() every step: the re-plan
    accounts = True  # account() tells which requests run
    uses_step_costs = True

    def __init__(
        self,
        prefill_s_per_token: float | None = None,
        decode_s_per_token: float | None = None,
        decode_work_s_per_token: float | None = None,
        decode_s_per_seq: float = 0.0,
        num_workers: int = 1,
        max_wait_s: float = 120.0,
        shed_hopeless: bool = False,
    ) -> None:
        self.steps = (
            StepClock() if prefill_s_per_token is None and decode_s_per_token is None else None
        )
        guess = ServiceCosts()  # until given or learned
        decode = guess.decode_s_per_token if decode_s_per_token is None else decode_s_per_token
        self.costs = ServiceCosts(
            guess.prefill_s_per_token if prefill_s_per_token is None else prefill_s_per_token,
            decode,
            decode if decode_work_s_per_token is None else decode_work_s_per_token,
        )
        if not (isinstance(decode_s_per_seq, int | float) and decode_s_per_seq >= 0):
            raise ValueError(f"decode_s_per_seq must be a number >= 0; got {decode_s_per_seq!r}")
        self.decode_s_per_seq = float(decode_s_per_seq)
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an integer >= 1; got {num_workers!r}")
        if not (isinstance(max_wait_s, int | float) and max_wait_s > 0):
            raise ValueError(f"max_wait_s must be a number of seconds > 0; got {max_wait_s!r}")
        self.num_workers = num_workers
        self.max_wait_s = float(max_wait_s)
        self.shed_hopeless = bool(shed_hopeless)
        self.predictor = OutputLengthPredictor()
        self.plan = GoodputPlan()
        self._known: dict[str, Request] = {}  # unfinished requests seen by key() or account()
        self.num_demoted = 0

    def measured(self, fit: StepFit, batch: int, num_workers: int) -> None:
        """Costs from the workers' measured step time: one more sequence in a decode step adds
        one token's marginal cost."""
        if not fit.usable:
            return
        self.steps = None  # the service's fit wins over the policy's own
        self._use(fit, batch)
        self.num_workers = max(1, num_workers)

    def _use(self, fit: StepFit, batch: int) -> None:
        self.costs = fit.service_costs(batch)
        self.decode_s_per_seq = fit.per_token_s

    # -- the plan ------------------------------------------------------------------------------
    def _outputs_left(self, request: Request) -> int:
        return self.predictor.outputs_left(request)

    def latency_s(self, request: Request) -> float:
        return latency_s(request, self._outputs_left(request), self.costs)

    def work_s(self, request: Request) -> float:
        return work_s(request, self._outputs_left(request), self.costs)

    def due(self, request: Request) -> float | None:
        return due(request, self._outputs_left(request), self.costs)

    def _too_slow(self, request: Request, step_s: float) -> bool:
        tpot = request.tpot_target_s
        return tpot is not None and step_s > tpot

    def _forget_finished(self) -> None:
        known = self._known
        done = [rid for rid, r in known.items() if r.status is RequestStatus.FINISHED]
        for rid in done:
            self.predictor.observe(known.pop(rid))

    def replan(self, now: float) -> GoodputPlan:
        """Hopeless, aged and feasible requests from now (see module doc)."""
        self._forget_finished()
        hopeless: set[str] = set()
        aged: set[str] = set()
        committed = 0.0  # worker time of what runs regardless of deadlines
        candidates: list[tuple[float, float, Request]] = []
        alone = self._step_s(1)
        for rid, r in self._known.items():
            d = self.due(r)
            waiting = r.status in _WAITING
            if waiting and now - r.arrival_time >= self.max_wait_s:
                aged.add(rid)
                committed += self.work_s(r)
            elif self._too_slow(r, alone) or (d is not None and now + self.latency_s(r) > d):
                hopeless.add(rid)
            elif d is None:
                if not waiting:
                    committed += self.work_s(r)
            else:
                candidates.append((d, r.arrival_time, r))
        candidates.sort(key=lambda c: (c[0], c[1]))
        share = 1.0 / self.num_workers
        t = committed * share
        chosen: list[tuple[float, str]] = []  # max-heap on work: (-work, id)
        rejected: set[str] = set()
        running: list[str] = []  # committed: they are in the batch already, never rejected
        for d, _, r in candidates:
            w = self.work_s(r) * share
            t += w
            if r.status in _WAITING:
                heapq.heappush(chosen, (-w, r.request_id))
            else:
                running.append(r.request_id)
            if now + t > d and chosen:
                neg_w, rid = heapq.heappop(chosen)
                t += neg_w
                rejected.add(rid)
        feasible = frozenset([*running, *(rid for _, rid in chosen)])
        old = self.plan
        self.num_demoted += sum(1 for rid in rejected | hopeless if old.standing(rid) in (1, 3))
        return GoodputPlan(feasible, frozenset(rejected), frozenset(hopeless), frozenset(aged))

    def refresh(self, now: float) -> bool:
        old = self.plan
        new = self.replan(now)
        self.plan = new
        if not self._waiting_keys_changed(old, new):
            return False
        self.generation += 1
        return True

    def _waiting_keys_changed(self, old: GoodputPlan, new: GoodputPlan) -> bool:
        for rid, r in self._known.items():
            if r.status not in _WAITING:
                continue
            before, after = old.standing(rid), new.standing(rid)
            if before != after and {before, after} != {1, 3}:
                return True  # (unplanned requests are keyed as feasible)
        return False

    def hopeless_waiting(self) -> list[Request]:
        """Waiting requests to end now (only with shed_hopeless)."""
        if not self.shed_hopeless:
            return []
        known = self._known
        return [known[rid] for rid in self.plan.hopeless if known[rid].status in _WAITING]

    def missed_target(self, request: Request) -> str:
        return missed_target(request, self._outputs_left(request), self.costs, self._step_s(1))

    def wants_seat(self, request: Request) -> bool:
        """Feasible, or aged (the wait bound is owed a seat too)."""
        return self.plan.standing(request.request_id) in (0, 1)

    def hopeless_running(self, running: Sequence[Request]) -> list[Request]:
        """Hopeless running requests, latest arrival first. One that has waited past
        ``max_wait_s`` since it arrived keeps its seat: it was readmitted by the wait bound, and
        unseating it again would starve it."""
        hopeless = self.plan.hopeless
        now = self.clock()
        out = [
            r
            for r in running
            if r.request_id in hopeless and now - r.arrival_time < self.max_wait_s
        ]
        out.sort(key=lambda r: r.arrival_time, reverse=True)
        return out

    # -- the interface -------------------------------------------------------------------------
    def key(self, request: Request) -> tuple[int, float, float]:
        rid = request.request_id
        if rid not in self._known:
            self._known[rid] = request
            self.predictor.predict(request)
        arrival = request.arrival_time
        standing = self.plan.standing(rid)
        if standing == 0:
            return (_FEASIBLE, arrival + self.max_wait_s, arrival)
        d = self.due(request)
        if d is None or standing == 2:
            return (_DEMOTED, arrival, arrival)
        # feasible, or not planned yet (a new arrival): feasible until a re-plan says otherwise
        return (_FEASIBLE, d, arrival)

    def admits(self, request: Request) -> bool:
        plan = self.plan
        if request.deadline is None and not self._deadlines_lost():
            return True  # TTFT/TPOT targets only, no deadline being lost: admitted as EDF would
        standing = plan.standing(request.request_id)
        if standing == 0:
            return True  # aged: the wait bound wins
        if standing == 2:
            return not plan.feasible  # best effort: only while no deadline can be won
        if self.due(request) is None:  # no target, or only a TPOT target: best effort too
            if plan.feasible:
                return False
            return request.tpot_target_s is None or self._fits_batch(request)
        return self._fits_batch(request)

    def _deadlines_lost(self) -> bool:
        """The plan rejects or gives up a request with a deadline: the load is past what
        admitting in order would serve."""
        known, plan = self._known, self.plan
        return any(
            known[rid].deadline is not None for rid in plan.rejected | plan.hopeless if rid in known
        )

    def _step_s(self, batch: int) -> float:
        per_worker = -(-batch // self.num_workers)
        return self.costs.decode_s_per_token + self.decode_s_per_seq * max(0, per_worker - 1)

    def _fits_batch(self, request: Request) -> bool:
        """Joining the batch, the request makes its targets and costs no running request its
        own (running requests already late or too slow do not count)."""
        now = self.clock()
        running = [r for r in self._known.values() if r.status is RequestStatus.RUNNING]
        step_now, step_then = self._step_s(len(running)), self._step_s(len(running) + 1)
        delay = tokens_to_compute(request) * self.costs.prefill_s_per_token
        if self._late(request, now, step_then) or self._too_slow(request, step_then):
            return False
        for r in running:
            if not has_targets(r) or self._too_slow(r, step_now):
                continue
            if self._too_slow(r, step_then):
                return False
            if self._late(r, now, step_now):
                continue
            if self._late(r, now + delay, step_then):
                return False
        return True

    def _late(self, request: Request, start: float, step_s: float) -> bool:
        """Misses its deadline, or its TTFT target, with its prefill from ``start`` and then
        decode steps of ``step_s``. The TTFT target is checked on the first token alone, not
        folded into a deadline as the plan does (``due`` assumes steps as fast as alone, which
        a batch never gives: every request with a TTFT target would be held back)."""
        prefill = tokens_to_compute(request) * self.costs.prefill_s_per_token
        d = request.deadline
        if d is not None and start + prefill + self._outputs_left(request) * step_s > d:
            return True
        first = request.ttft_deadline
        return (
            first is not None
            and request.num_output_tokens == 0
            and start + prefill + step_s > first
        )

    def victim_key(self, request: Request) -> tuple[int, float]:
        rid = request.request_id
        d = self.due(request)
        if d is None or rid not in self.plan.feasible:
            return (2, 0.0)
        recompute = request.num_computed_tokens * self.costs.prefill_s_per_token
        slack = d - (self.clock() + self.latency_s(request) + recompute)
        return (1, slack) if slack >= 0 else (0, slack)

    def account(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        known = self._known
        for r in requests:
            if r.request_id not in known:
                known[r.request_id] = r
                self.predictor.predict(r)
        steps = self.steps
        fit = None if steps is None else steps.step(self.clock(), requests, num_tokens)
        if steps is not None and fit is not None:
            self._use(fit, round(steps.batch))

    def forget(self, request: Request) -> None:
        """A request that ended outside the scheduler's view (shed, aborted)."""
        self._known.pop(request.request_id, None)
        self.predictor.forget(request.request_id)
