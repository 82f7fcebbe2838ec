"""A worker as the engine sees it: its registration, the transport that carries its steps, and
the session that holds its core Scheduler and bookkeeping. The engine, placement and observers
all speak of these; none of them needs the engine to name them."""

from __future__ import annotations

import abc
import asyncio
import time
from collections import Counter
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

from common.convert import TokenLogprobs
from scheduler_svc.core import Request, Scheduler, SchedulerOutput, count_prefix_blocks
from scheduler_svc.core.block_pool import BlockHash
from scheduler_svc.core.preemption_cost import WorkerCosts


class WorkerLost(Exception):
    """The worker's stream broke, it went silent, or it answered nonsense."""


@dataclass(slots=True)
class StepReply:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    forward_time_s: float = 0.0
    step_time_s: float = 0.0  # on the worker: step received to reply ready
    idle_time_s: float = 0.0  # on the worker: previous reply to this step's arrival


class WorkerTransport(Protocol):
    async def submit(self, out: SchedulerOutput) -> Awaitable:
        """Send a step; return a handle for result() (steps may be pipelined)."""

    async def result(self, out: SchedulerOutput, handle: Awaitable) -> StepReply:
        """The checked result of a submitted step; raises WorkerLost."""


class ExecuteTransport(abc.ABC):
    """A transport built on one `execute(out)` coroutine (in-process and test workers)."""

    @abc.abstractmethod
    async def execute(self, out: SchedulerOutput) -> StepReply:
        """Run one step to completion."""

    async def submit(self, out: SchedulerOutput) -> Awaitable:
        return asyncio.ensure_future(self.execute(out))

    async def result(self, out: SchedulerOutput, handle: Awaitable) -> StepReply:
        return await handle


@dataclass(slots=True)
class HeldRequest:
    """A request whose row a worker still held when its link broke: the KV of its first
    num_computed_tokens (of num_tokens known) tokens is in block_ids. A new leader adopts it
    (Scheduler.adopt_request) instead of computing it again."""

    request_id: str
    block_ids: list[int]
    num_computed_tokens: int
    num_tokens: int


@dataclass(slots=True)
class WorkerRegistration:
    worker_id: str
    model: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    address: str = ""
    costs: WorkerCosts | None = None  # measured by the worker (preemption cost model)
    kernels: str = ""  # the worker's CPU level and kernel per op family, as it reported them
    host: str = ""  # as the worker reported them (for /cluster)
    pid: int = 0
    epoch: int = 0  # the highest leader epoch the worker has accepted
    held: list[HeldRequest] = field(default_factory=list)  # rows it kept across a failover
    # its capacity: rows of its batch and tokens of one forward pass (0 = not reported: an
    # older or simulated worker); scheduled within the smaller of these and the scheduler's
    # own (worker_limits.py), as with max_model_len
    max_num_seqs: int = 0
    max_num_batched_tokens: int = 0
    # LoRA: adapter slots on its device (0: it serves none), the largest rank it takes, the
    # adapters it has read (LoraAdapter: name, path, rank) and those in its slots now
    max_loras: int = 0
    max_lora_rank: int = 0
    loras: list = field(default_factory=list)
    resident_loras: list[str] = field(default_factory=list)


@dataclass(slots=True, eq=False)
class WorkerSession:
    registration: WorkerRegistration
    scheduler: Scheduler
    transport: WorkerTransport
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    request_ids: set[str] = field(default_factory=set)
    inflight_hashes: Counter = field(default_factory=Counter)  # prefixes on their way here
    lost: bool = False
    lost_reason: str = ""
    draining: bool = False
    drain_deadline: float = 0.0
    num_drained_finished: int = 0
    num_steps: int = 0
    last_forward_time_s: float = 0.0
    total_worker_step_s: float = 0.0
    total_worker_idle_s: float = 0.0
    attached_at: float = field(default_factory=time.monotonic)
    resident_loras: set[str] = field(default_factory=set)  # adapters in its slots, as reported
    available_loras: set[str] = field(default_factory=set)  # adapters it has read (can run)
    # adapters of the requests placed here: in a slot by their first step, before it says so
    placed_loras: Counter = field(default_factory=Counter)

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    @property
    def load(self) -> int:
        return len(self.request_ids)

    @property
    def max_loras(self) -> int:
        """LoRA adapter slots, from its registration (0 = it runs no adapters)."""
        return self.registration.max_loras

    @property
    def accepting(self) -> bool:
        """Whether the engine may hand it new requests."""
        return not self.lost and not self.draining

    @property
    def held_request_ids(self) -> tuple[str, ...]:
        """Rows held for requests to place back here: only a step shard's workers have any
        (RemoteWorker); a takeover adopts a local worker's rows itself."""
        return ()

    @property
    def block_size(self) -> int:
        return self.scheduler.kv.block_size

    @property
    def num_local_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def max_num_seqs(self) -> int:
        return self.scheduler.config.max_num_seqs

    @property
    def worst_waiting_priority(self) -> int | None:
        """The largest priority value in its local queue (the last to be admitted there)."""
        return max((r.priority for r in self.scheduler.waiting), default=None)

    def cached_prefix_blocks(self, request: Request) -> int:
        """Leading full blocks of the request cached here or on their way here."""
        return count_prefix_blocks(self.scheduler.kv, request, self.inflight_hashes)

    def take(self, state: object, request: Request) -> list[BlockHash]:
        """Queue a placed request on this worker's core; returns the block hashes of its
        prefix, on their way here. Raises RequestRejected."""
        self.scheduler.add_request(request)
        kv = self.scheduler.kv
        hashes = list(kv.block_hashes(request, (request.num_tokens - 1) // kv.block_size))
        self.wakeup.set()
        return hashes

    def cancel(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)
        self.wakeup.set()

    @property
    def state(self) -> str:
        return "lost" if self.lost else "draining" if self.draining else "active"

    def mark_lost(self, reason: str) -> None:
        if not self.lost:
            self.lost = True
            self.lost_reason = reason
        self.wakeup.set()
