"""What the engine's helpers (WorkerPool, StepLoop, Takeover) see of the ServingEngine that owns
them: its shared state and the request-side operations they call back. Typed here, apart from
the engine, so that the helpers and the engine do not import each other."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import Request
from scheduler_svc.core.policy import SchedulingPolicy
from scheduler_svc.core.request_queue import RequestQueue
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.placement import PlacementConfig
from scheduler_svc.engine.slo_admission import SloAdmission
from scheduler_svc.engine.stream_pacing import StreamPacer
from scheduler_svc.engine.worker_session import WorkerSession
from scheduler_svc.obs.engine_observer import EngineObserver
from scheduler_svc.shards.remote_worker import RemoteWorker


class RowAdopter(Protocol):
    """The engine's Takeover as the dispatcher calls it."""

    def adopt(self, state: InFlightRequest, request: Request) -> bool: ...


class EngineHost(Protocol):
    config: SchedulerServiceConfig
    policy: SchedulingPolicy
    waiting: RequestQueue
    requests: dict[str, InFlightRequest]
    sessions: dict[str, WorkerSession]
    remote_workers: dict[str, RemoteWorker]
    placement: PlacementConfig
    takeover: RowAdopter
    observer: EngineObserver
    loras: Any  # LoraRegistry (lora_registry.py): the adapters and where they are read
    model_name: str
    slo: SloAdmission
    pacer: StreamPacer
    pacing_listeners: list[Callable[[int], None]]
    worker_attached: asyncio.Event
    may_act: Callable[[], bool]
    rebuilding: bool
    keeps_held_rows: bool
    _speculative: SpeculativeConfig | None
    _resumed: list[InFlightRequest]
    _held: dict[str, tuple[WorkerSession, Any]]
    _parked: dict[str, list[InFlightRequest]]

    def drop(self, request_id: str) -> None: ...
    def shed_hopeless_waiting(self) -> None: ...
    def _dispatch(self) -> None: ...
    def _live_sessions(self) -> list[WorkerSession]: ...
    def _await_worker(self, state: InFlightRequest) -> None: ...
    def _await_workers(self) -> None: ...
    def _cancel_wait_timer(self, state: InFlightRequest) -> None: ...
    def _fail_impossible(self, state: InFlightRequest) -> bool: ...
    def _leave_session(self, state: InFlightRequest) -> WorkerSession | None: ...
    def _shed(self, request: Request) -> None: ...
    def _end(self, state: InFlightRequest) -> None: ...
    def _unpark(self, first_id: str) -> None: ...
    def _requeue(self, state: InFlightRequest, reason: str) -> None: ...
