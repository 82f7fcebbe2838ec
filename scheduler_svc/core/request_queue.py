"""Waiting queues: a separate, injectable object (several Schedulers may share one).

Both kinds give O(1) ``len``/``in``/``remove`` (removal leaves a tombstone that pops skip; the
queue compacts itself when tombstones outnumber live entries):

- FIFORequestQueue (fifo policies, e.g. fcfs): a deque; add/pop/prepend O(1).
- KeyedRequestQueue (any other policy): a heap on ``policy.key``; add/pop O(log n). A "prepended"
  (preempted or skipped) request keeps its key, so under priority it keeps its arrival time and
  goes back before every request that arrived after it. When the policy bumps its
  ``generation`` (keys changed: deadline demotion), the heap re-sorts before its next peek/pop,
  so every queue sharing the policy (global, per worker, swapped) follows.
- A policy with a ``make_queue()`` method supplies its own (fair share: one heap per tenant).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from typing import Any

from scheduler_svc.core.policy import SchedulingPolicy, create_policy
from scheduler_svc.core.request import Request

_COMPACT_MIN = 64


class RequestQueue(ABC):
    """Waiting requests in policy order, indexed by request id."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self.policy = policy
        self._index: dict[str, list[Any]] = {}  # request_id -> entry; entry[-1] is the request
        self._dead = 0  # tombstones still inside the container

    # -- the interface the scheduler uses ---------------------------------------------------
    @abstractmethod
    def add(self, request: Request) -> None:
        """A new arrival."""

    @abstractmethod
    def prepend(self, request: Request) -> None:
        """Back to the head: a preempted request, or one skipped this step."""

    @abstractmethod
    def pop(self) -> Request:
        """Remove and return the head. IndexError when empty."""

    @abstractmethod
    def peek(self) -> Request | None:
        """The head, or None when empty."""

    @abstractmethod
    def _live_entries(self) -> Iterator[list[Any]]:
        """Live entries in container order."""

    @abstractmethod
    def _rebuild(self, entries: list[list[Any]]) -> None:
        """Replace the container by these live entries."""

    def remove(self, request_id: str) -> Request | None:
        """Remove a request from anywhere in the queue in O(1). None when absent."""
        entry = self._index.pop(request_id, None)
        if entry is None:
            return None
        request: Request = entry[-1]
        entry[-1] = None
        self._dead += 1
        if not self._index or (self._dead > _COMPACT_MIN and self._dead > len(self._index)):
            self._rebuild(list(self._live_entries()))
            self._dead = 0
        return request

    def get(self, request_id: str) -> Request | None:
        entry = self._index.get(request_id)
        return None if entry is None else entry[-1]

    def reorder(self) -> None:
        """Re-sort after the policy's keys changed (aging). O(n); also drops tombstones."""
        self._rebuild(list(self._live_entries()))
        self._dead = 0

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:
        return bool(self._index)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._index

    def __iter__(self) -> Iterator[Request]:
        """Live requests in the order they would be popped (O(n log n) for keyed queues)."""
        for entry in self._live_entries():
            yield entry[-1]

    def _register(self, request: Request, entry: list[Any]) -> None:
        rid = request.request_id
        if rid in self._index:
            raise ValueError(f"request {rid!r} is already in the waiting queue")
        self._index[rid] = entry


class FIFORequestQueue(RequestQueue):
    def __init__(self, policy: SchedulingPolicy) -> None:
        super().__init__(policy)
        self._dq: deque[list[Any]] = deque()

    def add(self, request: Request) -> None:
        entry = [request]
        self._register(request, entry)
        self._dq.append(entry)

    def prepend(self, request: Request) -> None:
        entry = [request]
        self._register(request, entry)
        self._dq.appendleft(entry)

    def pop(self) -> Request:
        dq = self._dq
        while dq:
            request: Request | None = dq.popleft()[0]
            if request is not None:
                del self._index[request.request_id]
                if not self._index and self._dead:  # only tombstones left: drop them
                    self._rebuild([])
                    self._dead = 0
                return request
            self._dead -= 1
        raise IndexError("pop from an empty waiting queue")

    def peek(self) -> Request | None:
        dq = self._dq
        while dq:
            request: Request | None = dq[0][0]
            if request is not None:
                return request
            dq.popleft()
            self._dead -= 1
        return None

    def _live_entries(self) -> Iterator[list[Any]]:
        return (e for e in self._dq if e[0] is not None)

    def _rebuild(self, entries: list[list[Any]]) -> None:
        self._dq = deque(entries)


class KeyedRequestQueue(RequestQueue):
    """A heap of [key, seq, request]; seq breaks ties (prepends get negative seqs, so they win)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        super().__init__(policy)
        self._heap: list[list[Any]] = []
        self._seq = itertools.count()
        self._preseq = itertools.count(-1, -1)
        self._gen = policy.generation  # keys are as of this policy generation

    def add(self, request: Request) -> None:
        entry = [self.policy.key(request), next(self._seq), request]
        self._register(request, entry)
        heapq.heappush(self._heap, entry)

    def prepend(self, request: Request) -> None:
        entry = [self.policy.key(request), next(self._preseq), request]
        self._register(request, entry)
        heapq.heappush(self._heap, entry)

    def pop(self) -> Request:
        if self._gen != self.policy.generation:
            self.reorder()
        heap = self._heap
        while heap:
            request: Request | None = heapq.heappop(heap)[2]
            if request is not None:
                del self._index[request.request_id]
                if not self._index and self._dead:  # only tombstones left: drop them
                    self._rebuild([])
                    self._dead = 0
                return request
            self._dead -= 1
        raise IndexError("pop from an empty waiting queue")

    def peek(self) -> Request | None:
        if self._gen != self.policy.generation:
            self.reorder()
        heap = self._heap
        while heap:
            request: Request | None = heap[0][2]
            if request is not None:
                return request
            heapq.heappop(heap)
            self._dead -= 1
        return None

    def reorder(self) -> None:
        self._gen = self.policy.generation
        key = self.policy.key
        entries = list(self._index.values())
        for entry in entries:
            entry[0] = key(entry[2])
        self._rebuild(entries)
        self._dead = 0

    def _live_entries(self) -> Iterator[list[Any]]:
        return iter(sorted(e for e in self._heap if e[2] is not None))

    def _rebuild(self, entries: list[list[Any]]) -> None:
        heapq.heapify(entries)
        self._heap = entries


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    """The queue that fits the policy (a policy object or a registered name)."""
    if isinstance(policy, str):
        policy = create_policy(policy)
    make_queue = getattr(policy, "make_queue", None)
    if make_queue is not None:  # a policy with its own queue structure (fair share)
        queue: RequestQueue = make_queue()
        return queue
    return FIFORequestQueue(policy) if policy.fifo else KeyedRequestQueue(policy)
