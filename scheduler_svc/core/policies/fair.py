"""Weighted fair share of computed tokens across tenants.

Each tenant has a virtual time: tokens computed for it (prefill and decode, as scheduled)
divided by its weight. The waiting queue serves the backlogged tenant with the smallest virtual
time next (within a tenant: priority, then arrival), so while several tenants have work their
tokens follow the weights (10:1 weights: ~10:1 tokens), and a tenant with nothing queued simply
drops out, leaving its share to the others. A tenant that becomes active again (a first
request, or one after an idle spell) starts at the smallest virtual time among the active
tenants, never below: idleness banks no credit. The victim of a preemption belongs to the
tenant furthest ahead of its share (then: least wasted work).

Admission decides who runs, but a request's tokens are computed over many steps after it: a
tenant would look cheap until its admitted requests had run, and get too many admitted. So the
first time a request is scheduled its tenant is charged what it is expected to compute in all
(its tokens not yet computed, and its remaining output at the tenant's average output length so
far, at most max_tokens); later steps charge only beyond that, and when it finishes the part
not used is given back. Between leaving a queue and being scheduled (admission within one
step) the same amount is held as pending, so one step cannot admit a burst from one tenant.
``served`` counts the tokens really computed.

The scheduler core reports tokens through ``account`` after every step, so per-tenant service
is counted wherever the core runs (the engine's workers, which share this policy object, and
the simulator).
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from scheduler_svc.core.policy import SchedulingPolicy, register_policy
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.request_queue import KeyedRequestQueue, RequestQueue

_FINISHED = RequestStatus.FINISHED
_COMPACT_MIN = 256
OUTPUT_GUESS = 1024  # expected output length of a tenant's first requests (capped by max_tokens)


@register_policy
class FairSharePolicy(SchedulingPolicy):
    name = "fair"
    accounts = True

    def __init__(
        self, weights: Mapping[str, float] | None = None, default_weight: float = 1.0
    ) -> None:
        for tenant, w in {**(weights or {}), "(default)": default_weight}.items():
            if (
                isinstance(w, bool)
                or not isinstance(w, int | float)
                or not (math.isfinite(w) and w > 0)
            ):
                raise ValueError(f"tenant weight must be a finite number > 0: {tenant}={w!r}")
        self.weights = dict(weights or {})
        self.default_weight = float(default_weight)
        self.vtime: dict[str, float] = {}  # tenant -> tokens served / weight (lifted, see above)
        self.served: dict[str, int] = {}  # tenant -> tokens computed for it
        self._vclock = 0.0  # virtual time of the system when no tenant is active
        # tenant -> its requests known to be unfinished, in first-seen order (lazily purged)
        self._live: dict[str, OrderedDict[str, Request]] = {}
        self._compact_at: dict[str, int] = {}
        # scheduled, unfinished requests: id -> [request, tokens charged, tokens computed]
        self._open: dict[str, list[Any]] = {}
        self._mean_output: dict[str, float] = {}  # tenant -> average output length (EWMA)
        # popped from a queue, not yet scheduled: id -> [request, expected tokens]
        self._pending: dict[str, list[Any]] = {}
        self._pending_sum: dict[str, float] = {}  # tenant -> pending tokens

    # -- tenants ----------------------------------------------------------------------------
    @staticmethod
    def tenant_of(request: Request) -> str:
        return request.tenant or ""

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, self.default_weight)

    def shares(self) -> dict[str, float]:
        """Fraction of all tokens served per tenant so far."""
        total = sum(self.served.values())
        return {t: n / total for t, n in self.served.items()} if total else {}

    # -- SchedulingPolicy -------------------------------------------------------------------
    def key(self, request: Request) -> tuple[int, float]:
        """Order within one tenant."""
        return (request.priority, request.arrival_time)

    def victim_key(self, request: Request) -> tuple[float]:
        return (self.vtime.get(self.tenant_of(request), 0.0),)

    def make_queue(self) -> TenantFairQueue:
        return TenantFairQueue(self)

    def expected_output(self, request: Request) -> int:
        """Output tokens a request is expected to produce in all: its tenant's average so
        far (initially max_tokens, at most 1024), never above max_tokens."""
        cap = request.sampling_params.max_tokens
        mean = self._mean_output.get(request.tenant or "", min(cap, OUTPUT_GUESS))
        return max(request.num_output_tokens + 1, min(cap, round(mean)))

    def expected_tokens(self, request: Request) -> int:
        """Tokens a waiting request is expected to compute in all."""
        left = request.num_tokens - request.num_computed_tokens
        return max(1, left) + max(0, self.expected_output(request) - request.num_output_tokens - 1)

    def rank(self, tenant: str) -> float:
        """Virtual time with pending admissions: the tenant served next has the smallest."""
        v = self.vtime.get(tenant, 0.0)
        pending = self._pending_sum.get(tenant)
        return v + pending / self.weight(tenant) if pending else v

    def on_pop(self, request: Request) -> None:
        """It left a queue (to be admitted, most likely): hold its expected cost as pending."""
        rid = request.request_id
        self._unpend(rid)
        amount = self.expected_tokens(request)
        self._pending[rid] = [request, amount]
        t = request.tenant or ""
        self._pending_sum[t] = self._pending_sum.get(t, 0.0) + amount

    def _unpend(self, rid: str) -> None:
        entry = self._pending.pop(rid, None)
        if entry is not None:
            t = entry[0].tenant or ""
            left = self._pending_sum.get(t, 0.0) - entry[1]
            self._pending_sum[t] = left if left > 1e-9 else 0.0

    def account(self, requests: Sequence[Request], num_tokens: Sequence[int]) -> None:
        vtime, served, open_ = self.vtime, self.served, self._open
        lowest = math.inf
        for request, n in zip(requests, num_tokens, strict=True):
            t = request.tenant or ""
            served[t] = served.get(t, 0) + n
            if self._pending:
                self._unpend(request.request_id)
            entry = open_.get(request.request_id)
            if entry is None:  # first scheduled: charge what it should compute in all
                later = request.num_tokens - request.num_computed_tokens  # known, after this
                outputs = self.expected_output(request) - request.num_output_tokens
                charge = n + max(0, later) + max(0, outputs - 1)
                open_[request.request_id] = [request, charge, n]
            else:
                entry[0] = request  # (a migrated request is a new object)
                entry[2] += n
                charge = max(0, entry[2] - entry[1])  # beyond the estimate (e.g. recompute)
                entry[1] += charge
            v = vtime.get(t, self._vclock) + charge / self.weight(t)
            vtime[t] = v
            if v < lowest:
                lowest = v
        if lowest != math.inf and lowest > self._vclock:
            self._vclock = lowest
        self._settle()

    def _settle(self) -> None:
        """Give back what finished requests were charged and did not compute."""
        for rid in [rid for rid, e in self._pending.items() if e[0].status is _FINISHED]:
            self._unpend(rid)  # popped, then aborted or refused before running
        done = [rid for rid, e in self._open.items() if e[0].status is _FINISHED]
        for rid in done:
            request, charged, used = self._open.pop(rid)
            t = request.tenant or ""
            if charged > used:
                self.vtime[t] = self.vtime.get(t, 0.0) - (charged - used) / self.weight(t)
            m = self._mean_output.get(t)
            n = request.num_output_tokens
            self._mean_output[t] = n if m is None else 0.8 * m + 0.2 * n

    # -- activity ---------------------------------------------------------------------------
    def on_enqueue(self, request: Request) -> None:
        """A request of this tenant entered a queue ordered by this policy."""
        t = self.tenant_of(request)
        if self._pending:
            self._unpend(request.request_id)  # back in a queue: not being admitted
        if not self.is_active(t):
            floor = self.system_vtime(exclude=t)
            if self.vtime.get(t, -math.inf) < floor:
                self.vtime[t] = floor
        live = self._live.get(t)
        if live is None:
            live = self._live[t] = OrderedDict()
        live[request.request_id] = request  # a known id keeps its place (a new object: migrated)
        if len(live) > max(_COMPACT_MIN, 2 * self._compact_at.get(t, 0)):
            for rid in [rid for rid, r in live.items() if r.status is _FINISHED]:
                del live[rid]
            self._compact_at[t] = len(live)

    def is_active(self, tenant: str) -> bool:
        """Does the tenant have an unfinished request (waiting, running, preempted)?"""
        live = self._live.get(tenant)
        while live:
            rid = next(iter(live))
            if live[rid].status is not _FINISHED:
                return True
            live.popitem(last=False)
        return False

    def system_vtime(self, exclude: str | None = None) -> float:
        """The smallest virtual time among active tenants (the system's virtual clock when
        none is active)."""
        active = [
            self.vtime.get(t, self._vclock)
            for t in self._live
            if t != exclude and self.is_active(t)
        ]
        return min(active) if active else self._vclock


class TenantFairQueue(RequestQueue):
    """One priority heap per tenant; the head is the head of the backlogged tenant with the
    smallest virtual time (O(tenants) per peek/pop)."""

    policy: FairSharePolicy

    def __init__(self, policy: FairSharePolicy) -> None:
        super().__init__(policy)
        self._subs: dict[str, KeyedRequestQueue] = {}
        self._where: dict[str, str] = {}  # request id -> tenant

    def _enqueue(self, request: Request, front: bool) -> None:
        rid = request.request_id
        if rid in self._where:
            raise ValueError(f"request {rid!r} is already in the waiting queue")
        policy = self.policy
        policy.on_enqueue(request)
        t = policy.tenant_of(request)
        sub = self._subs.get(t)
        if sub is None:
            sub = self._subs[t] = KeyedRequestQueue(policy)
        if front:
            sub.prepend(request)
        else:
            sub.add(request)
        self._where[rid] = t

    def add(self, request: Request) -> None:
        self._enqueue(request, front=False)

    def prepend(self, request: Request) -> None:
        self._enqueue(request, front=True)

    def _pick(self) -> KeyedRequestQueue | None:
        rank = self.policy.rank
        best: KeyedRequestQueue | None = None
        best_key: tuple[float, str] | None = None
        empty = []
        for t, sub in self._subs.items():
            if not sub:
                empty.append(t)
                continue
            k = (rank(t), t)
            if best_key is None or k < best_key:
                best, best_key = sub, k
        for t in empty:
            del self._subs[t]
        return best

    def pop(self) -> Request:
        sub = self._pick()
        if sub is None:
            raise IndexError("pop from an empty waiting queue")
        request = sub.pop()
        del self._where[request.request_id]
        self.policy.on_pop(request)
        return request

    def peek(self) -> Request | None:
        sub = self._pick()
        return None if sub is None else sub.peek()

    def remove(self, request_id: str) -> Request | None:
        t = self._where.pop(request_id, None)
        return None if t is None else self._subs[t].remove(request_id)

    def get(self, request_id: str) -> Request | None:
        t = self._where.get(request_id)
        return None if t is None else self._subs[t].get(request_id)

    def reorder(self) -> None:
        for sub in self._subs.values():
            sub.reorder()

    def __len__(self) -> int:
        return len(self._where)

    def __bool__(self) -> bool:
        return bool(self._where)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._where

    def __iter__(self) -> Iterator[Request]:
        """The expected pop order: tenants interleaved by virtual time, each request charged
        its expected tokens (actual service decides the real order)."""
        policy = self.policy
        heap: list[tuple[float, str, Iterator[Request]]] = []
        for t, sub in self._subs.items():
            if sub:
                heap.append((policy.rank(t), t, iter(sub)))
        heapq.heapify(heap)
        while heap:
            v, t, it = heap[0]
            request = next(it, None)
            if request is None:
                heapq.heappop(heap)
                continue
            yield request
            cost = policy.expected_tokens(request)
            heapq.heapreplace(heap, (v + cost / policy.weight(t), t, it))

    def tenants(self) -> dict[str, int]:
        """Waiting requests per tenant."""
        return {t: len(sub) for t, sub in self._subs.items() if sub}

    def _live_entries(self) -> Iterator[list[Any]]:
        return ([r] for r in self)

    def _rebuild(self, entries: list[list[Any]]) -> None:
        # unreachable: remove() and reorder(), the base class's only callers, are overridden
        # above to act on the per-tenant queues, which compact themselves
        raise NotImplementedError("TenantFairQueue keeps one heap per tenant")
