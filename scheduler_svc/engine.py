"""The serving engine: requests, workers and one step loop per worker. No gRPC in here.

Each attached worker gets its own core Scheduler (block pool, running set). A request is placed
on the least-loaded worker, or waits (up to worker_wait_timeout) until one attaches. When a
worker is lost, its unfinished requests move to another worker carrying the tokens they already
produced, so the client's stream continues where it stopped.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

from common.convert import TokenLogprobs
from common.logging import get_logger
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import (
    FinishReason,
    RequestOutput,
    RequestRejected,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from scheduler_svc.observer import EngineObserver
from scheduler_svc.request_state import RequestState

log = get_logger("splitserve.engine")


class WorkerLost(Exception):
    """The worker's stream broke, it went silent, or it answered nonsense."""


@dataclass(slots=True)
class StepReply:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    forward_time_s: float = 0.0
    step_time_s: float = 0.0


class WorkerTransport(Protocol):
    async def execute(self, out: SchedulerOutput) -> StepReply: ...


@dataclass(slots=True)
class WorkerRegistration:
    worker_id: str
    model: str
    block_size: int
    num_device_blocks: int
    num_host_blocks: int
    max_model_len: int
    address: str = ""


@dataclass(slots=True, eq=False)
class WorkerSession:
    registration: WorkerRegistration
    scheduler: Scheduler
    transport: WorkerTransport
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    request_ids: set[str] = field(default_factory=set)
    lost: bool = False
    lost_reason: str = ""
    num_steps: int = 0
    last_forward_time_s: float = 0.0
    attached_at: float = field(default_factory=time.monotonic)

    @property
    def worker_id(self) -> str:
        return self.registration.worker_id

    def mark_lost(self, reason: str) -> None:
        if not self.lost:
            self.lost = True
            self.lost_reason = reason
        self.wakeup.set()

    @property
    def load(self) -> int:
        return len(self.request_ids)


class ServingEngine:
    def __init__(self, config: SchedulerServiceConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.requests: dict[str, RequestState] = {}
        self.sessions: dict[str, WorkerSession] = {}
        self.unassigned: dict[str, RequestState] = {}  # waiting for any worker, in arrival order
        self.num_finished = 0
        self.worker_attached = asyncio.Event()
        self.observer = EngineObserver()

    # ---- requests -------------------------------------------------------------------------
    def submit(self, state: RequestState) -> None:
        """Accept a validated request. Raises RequestRejected when it can never run."""
        if state.request_id in self.requests:
            raise RequestRejected(
                f"request id {state.request_id!r} is already in flight; use a unique id"
            )
        self.requests[state.request_id] = state
        try:
            self._place(state)
        except RequestRejected:
            del self.requests[state.request_id]
            raise
        self.observer.on_request_accepted(state)

    def _end(self, state: RequestState) -> None:
        """Bookkeeping once a request's stream has its last message."""
        self.requests.pop(state.request_id, None)
        state.finish_time = time.monotonic()
        self.num_finished += 1
        self.observer.on_request_finished(state)

    def _place(self, state: RequestState) -> None:
        session = self._pick_worker()
        if session is None:
            self.unassigned[state.request_id] = state
            loop = asyncio.get_running_loop()
            state.wait_timer = loop.call_later(
                self.config.worker_wait_timeout, self._expire_unassigned, state.request_id
            )
            return
        session.scheduler.add_request(state.to_core_request())
        state.worker_id = session.worker_id
        session.request_ids.add(state.request_id)
        session.wakeup.set()
        log.debug(
            "placed",
            request_id=state.request_id,
            worker_id=session.worker_id,
            reason="least_loaded",
            load=session.load,
        )

    def _pick_worker(self) -> WorkerSession | None:
        live = [s for s in self.sessions.values() if not s.lost]
        return min(live, key=lambda s: s.load) if live else None

    def _expire_unassigned(self, request_id: str) -> None:
        state = self.unassigned.pop(request_id, None)
        if state is None:
            return
        state.fail(
            f"no worker attached within {self.config.worker_wait_timeout:g} s; "
            "start a worker (splitserve worker --scheduler HOST:PORT) and retry",
            code="UNAVAILABLE",
        )
        self._end(state)

    def abort(self, request_id: str) -> bool:
        """Abort a request in any state; its stream ends with finish reason abort."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._release(state)
        state.end_aborted()
        self._end(state)
        return True

    def drop(self, request_id: str) -> None:
        """The client went away: free everything, tell nobody."""
        state = self.requests.get(request_id)
        if state is not None:
            self._release(state)
            if not state.finished:
                state.finish_reason = FinishReason.ABORT
            self._end(state)

    def _release(self, state: RequestState) -> None:
        if self.unassigned.pop(state.request_id, None) is not None and state.wait_timer:
            state.wait_timer.cancel()
        session = self.sessions.get(state.worker_id or "")
        if session is not None:
            session.scheduler.abort_request(state.request_id)
            session.request_ids.discard(state.request_id)
            session.wakeup.set()

    # ---- workers --------------------------------------------------------------------------
    def attach(self, registration: WorkerRegistration, transport: WorkerTransport) -> WorkerSession:
        old = self.sessions.get(registration.worker_id)
        if old is not None:
            self.detach(old, "replaced by a new connection with the same worker id")
        cfg = self.config
        sched_cfg = SchedulerConfig(
            max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_num_seqs=cfg.max_num_seqs,
            block_size=registration.block_size,
            num_blocks=registration.num_device_blocks,
            num_host_blocks=registration.num_host_blocks,
            watermark=cfg.watermark,
            policy=cfg.scheduling_policy,
            preemption_mode=cfg.preemption_mode,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            enable_prefix_caching=cfg.enable_prefix_caching,
            max_model_len=min(cfg.max_model_len, registration.max_model_len),
            long_prefill_token_threshold=cfg.long_prefill_token_threshold,
        )
        session = WorkerSession(registration, Scheduler(sched_cfg), transport)
        self.sessions[registration.worker_id] = session
        self.worker_attached.set()
        self.observer.on_worker_attached(session)
        log.info(
            "worker_attached",
            worker_id=registration.worker_id,
            num_blocks=registration.num_device_blocks,
            block_size=registration.block_size,
            address=registration.address,
        )
        pending = list(self.unassigned.values())
        self.unassigned.clear()
        for state in pending:
            if state.wait_timer:
                state.wait_timer.cancel()
            self._place_or_fail(state)
        return session

    def _place_or_fail(self, state: RequestState) -> None:
        try:
            self._place(state)
        except RequestRejected as exc:
            state.fail(str(exc), code="INVALID_ARGUMENT")
            self._end(state)

    def detach(self, session: WorkerSession, reason: str) -> None:
        """The worker is gone: move its unfinished requests elsewhere."""
        session.mark_lost(reason)
        if self.sessions.get(session.worker_id) is session:
            del self.sessions[session.worker_id]
        if not self.sessions:
            self.worker_attached.clear()
        moved = 0
        for request_id in list(session.request_ids):
            state = self.requests.get(request_id)
            if state is None or state.finished:
                continue
            state.num_migrations += 1
            state.worker_id = None
            if state.num_migrations > self.config.max_migrations:
                state.fail(
                    f"request lost its worker {state.num_migrations} times "
                    f"(limit --max-migrations {self.config.max_migrations}); last: {reason}",
                    code="UNAVAILABLE",
                )
                self._end(state)
                continue
            self._place_or_fail(state)
            moved += 1
        session.request_ids.clear()
        self.observer.on_worker_detached(session, reason)
        log.warning("worker_detached", worker_id=session.worker_id, reason=reason, migrated=moved)

    async def run_worker(self, session: WorkerSession) -> None:
        """The step loop of one worker: schedule, execute remotely, apply. Ends when it is lost."""
        sched = session.scheduler
        while not session.lost:
            out = sched.schedule()
            if not _has_work(out):
                session.wakeup.clear()
                if sched.has_unfinished_requests():
                    # requests wait for something outside this step (e.g. blocks): poll
                    try:
                        await asyncio.wait_for(session.wakeup.wait(), 0.05)
                    except TimeoutError:
                        pass
                else:
                    await session.wakeup.wait()
                continue
            started = time.perf_counter()
            try:
                reply = await session.transport.execute(out)
            except WorkerLost as exc:
                session.mark_lost(str(exc))
                return
            if session.lost:
                return
            session.num_steps += 1
            session.last_forward_time_s = reply.forward_time_s
            outputs = sched.update_from_output(out, reply.sampled)
            self.observer.on_step(session, out, reply, time.perf_counter() - started)
            now = time.monotonic()
            for output in outputs:
                self._deliver(session, output, reply.logprobs.get(output.request_id), now)

    def _deliver(
        self,
        session: WorkerSession,
        output: RequestOutput,
        logprobs: list[TokenLogprobs] | None,
        now: float,
    ) -> None:
        state = self.requests.get(output.request_id)
        if state is None:
            return
        stopped_by_string = state.push_tokens(
            output.new_token_ids, output.finish_reason, output.stop_reason, logprobs, now
        )
        if output.new_token_ids:
            self.observer.on_tokens(state, len(output.new_token_ids), now)
        if stopped_by_string:
            session.scheduler.abort_request(output.request_id)
        if state.finished:
            session.request_ids.discard(output.request_id)
            self._end(state)

    # ---- introspection --------------------------------------------------------------------
    def worker_stats(self) -> list[tuple[WorkerSession, SchedulerStats]]:
        return [(s, s.scheduler.stats()) for s in self.sessions.values()]


def _has_work(out: SchedulerOutput) -> bool:
    return bool(
        out.total_num_scheduled_tokens
        or out.finished_req_ids
        or out.preempted_req_ids
        or out.blocks_to_swap_out
    )
