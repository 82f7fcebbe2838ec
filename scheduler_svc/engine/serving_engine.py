"""The serving engine: one global waiting queue, workers, one step loop per worker. No gRPC.

Requests wait in ONE queue ordered by the configured policy, so priority and fairness hold
across workers. Each attached worker has its own core Scheduler (block pool, running set, a
short local waiting list); the engine hands it requests from the head of the global queue just
in time, while its local list is short, choosing the worker by cached prefix and load
(placement.py). When a worker is lost, its unfinished requests go back to the head of the
global queue carrying the tokens they already streamed and continue elsewhere by recompute.
While no worker takes requests, every request waiting in the global queue fails after
--worker-wait-timeout, however it got there; the first worker to attach gets them all.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from common.logging import get_logger
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import (
    FinishReason,
    Request,
    RequestRejected,
    SchedulerStats,
    create_policy,
    create_request_queue,
    validate_request,
)
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.engine import placement
from scheduler_svc.engine.dispatcher import Dispatcher
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.lora_registry import LoraRegistry
from scheduler_svc.engine.slo_admission import SloAdmission
from scheduler_svc.engine.step_loop import StepLoop
from scheduler_svc.engine.stream_pacing import StreamPacer
from scheduler_svc.engine.takeover import Takeover
from scheduler_svc.engine.tenant_admission import (
    AdmissionControl,
    parse_tenant_seconds,
    parse_tenants,
)
from scheduler_svc.engine.worker_pool import WorkerPool
from scheduler_svc.engine.worker_session import (
    WorkerRegistration,
    WorkerSession,
    WorkerTransport,
)
from scheduler_svc.ha import cluster_view
from scheduler_svc.obs.engine_observer import EngineObserver
from scheduler_svc.shards.remote_worker import RemoteWorker

log = get_logger("splitserve.engine")


class ServingEngine:
    def __init__(self, config: SchedulerServiceConfig, model_name: str, vocab_size: int) -> None:
        self.pacer = StreamPacer.from_setting(config.stream_interval, config.async_scheduling)
        self.config = config
        self.model_name = model_name
        # read from the model itself: workers are held to it, not to what they declare
        self.vocab_size = vocab_size
        self.policy = create_policy(config.scheduling_policy, **policy_options(config))
        self.waiting = create_request_queue(self.policy)  # global, core Requests
        self.requests: dict[str, InFlightRequest] = {}
        self.sessions: dict[str, WorkerSession] = {}
        # workers of step shards (scheduler_svc/shards/): placed on exactly as local ones,
        # stepped by their shard's process
        self.remote_workers: dict[str, RemoteWorker] = {}
        self.shard_links: dict[str, Any] = {}  # shard id -> its ShardSession (shards/)
        # on a step shard: where a request goes that lost its worker (back to the leader's
        # queue) instead of this engine's own queue
        self.requeue_to: Callable[[InFlightRequest, str], None] | None = None
        self.num_finished = 0
        self.worker_attached = asyncio.Event()
        self.observer = EngineObserver()
        self.slo = SloAdmission.from_config(config)  # TTFT target, thrash backpressure
        self.admission = AdmissionControl(
            config.max_waiting_requests,
            config.tenant_rate_limit,
            config.tenant_burst,
            parse_tenants(config.tenants),
        )
        # a tenant's TTFT and TPOT targets, for its requests that set none of their own
        self.tenant_ttft = parse_tenant_seconds(config.tenant_ttft_targets, "--tenant-ttft-targets")
        self.tenant_tpot = parse_tenant_seconds(config.tenant_tpot_targets, "--tenant-tpot-targets")
        self._speculative = SpeculativeConfig.from_flag(config.speculative_config)
        self.frontends: dict[str, Any] = {}  # front-end id -> its FrontendSession (remote ones)
        # the in-process front-end's streams follow the adaptive --stream-interval through these
        self.pacing_listeners: list[Callable[[int], None]] = []
        # a new leader rebuilding (takeover.py): nothing is dispatched until the
        # workers and front-ends of the old leader have reported what they hold
        self.rebuilding = False
        # a step shard keeps the rows a worker held when it attaches (its old shard died):
        # the leader places their requests back on it (place() adopts them)
        self.keeps_held_rows = False
        self._resumed: list[InFlightRequest] = []  # reported by front-ends during the rebuild
        self._held: dict[str, tuple[WorkerSession, Any]] = {}  # request id -> worker row
        self.may_act: Callable[[], bool] = lambda: True  # False once leadership is lost
        self._parked: dict[str, list[InFlightRequest]] = {}  # first of a group -> its siblings
        self.takeover = Takeover(self)
        self.loras = LoraRegistry(self)  # the LoRA adapters requests may name, per worker
        self.pool = WorkerPool(self)
        self.steps = StepLoop(self)
        self.dispatcher = Dispatcher(self)
        self.placement = placement.PlacementConfig(
            min_prefix_tokens=config.placement_min_prefix_tokens,
            balance_abs=config.placement_balance_abs,
            balance_rel=config.placement_balance_rel,
        )

    # ---- requests -------------------------------------------------------------------------
    def submit(self, state: InFlightRequest) -> None:
        """Accept a validated request. Raises RequestRejected when it can never run."""
        if self.owner(state.request_id) is not None:
            raise RequestRejected(
                f"request id {state.request_id!r} is already in flight; use a unique id"
            )
        impossible = self._impossible_token(state)
        if impossible:
            raise RequestRejected(impossible)
        if state.lora_name and not self.loras.serves(state.lora_name):
            raise RequestRejected(f"no LoRA adapter {state.lora_name!r} is loaded")
        self.admission.check(state.tenant, len(self.waiting))
        tenant = state.tenant or ""
        if state.ttft_target_s is None:
            state.ttft_target_s = self.tenant_ttft.get(tenant)
        if state.tpot_target_s is None:
            state.tpot_target_s = self.tenant_tpot.get(tenant)
        request = state.to_core_request()
        live = self._live_sessions()
        configs = [s.scheduler.config for s in live]
        configs += [r.config for r in self.remote_workers.values() if not r.lost]
        if configs:  # refuse now what even the largest worker could never run
            validate_request(request, max(configs, key=lambda c: c.num_blocks))
        self.slo.check(request, [self.waiting], [s.scheduler for s in live])
        self.requests[state.request_id] = state
        state.core = request
        self.observer.on_request_accepted(state)
        first = self.requests.get(state.prefill_after or "")
        if first is not None and first.first_token_time is None and first is not state:
            # a sibling of an n > 1 group: runs once the first one's prompt is in the cache
            self._parked.setdefault(first.request_id, []).append(state)
            return
        self.waiting.add(request)
        self._await_worker(state)
        self._dispatch()

    def owner(self, request_id: str) -> str | None:
        """Who has this request in flight: its front-end's id ("" for a client of this process),
        or None when nobody has (also while a takeover waits to place it)."""
        state = self.requests.get(request_id)
        if state is None:
            state = next((s for s in self._resumed if s.request_id == request_id), None)
        return None if state is None else state.frontend_id

    # ---- a front-end's resumed requests and a new leader's rebuild (engine/takeover.py) ----
    def resume(self, states: list[InFlightRequest]) -> int:
        return self.takeover.resume(states)

    def begin_rebuild(self) -> None:
        self.takeover.begin_rebuild()

    def finish_rebuild(self) -> tuple[int, int, int]:
        return self.takeover.finish_rebuild()

    @property
    def num_waiting(self) -> int:
        """Requests in the global queue (not yet on any worker)."""
        return len(self.waiting)

    def _live_sessions(self) -> list[WorkerSession]:
        return [s for s in self.sessions.values() if not s.lost]

    def _impossible_token(self, state: InFlightRequest) -> str:
        """Token ids from outside this process (a front-end's prompt; after a takeover, the
        tokens a client already has, which an older leader took from a worker) must be inside
        the vocabulary: a single one outside fails every step of the worker it is sent to."""
        for what, ids in (
            ("prompt", state.prompt_token_ids),
            ("output", state.output_token_ids),
            ("prediction", state.params.prediction),
        ):
            if ids and max(ids) >= self.vocab_size:
                return (
                    f"{what} token id {max(ids)} of request {state.request_id!r} is outside the "
                    f"model's vocabulary (0..{self.vocab_size - 1})"
                )
        return ""

    def _fail_impossible(self, state: InFlightRequest) -> bool:
        impossible = self._impossible_token(state)
        if impossible:
            state.fail(impossible, code="INVALID_ARGUMENT")
        return bool(impossible)

    # ---- --worker-wait-timeout: runs exactly while no worker takes requests -----------------
    def _accepting(self) -> bool:
        return any(s.accepting for s in self.sessions.values()) or any(
            r.accepting for r in self.remote_workers.values()
        )

    def _await_worker(self, state: InFlightRequest) -> None:
        """A request just queued: with no worker to take it, it fails after the timeout."""
        if not self._accepting():
            self._start_wait_timer(state)

    def _await_workers(self) -> None:
        """The last worker that took requests is gone or leaving: every queued request waits
        at most the timeout from now."""
        if self._accepting():
            return
        for request in self.waiting:
            state = self.requests.get(request.request_id)
            if state is not None:
                self._start_wait_timer(state)

    def _start_wait_timer(self, state: InFlightRequest) -> None:
        if state.wait_timer is None:
            state.wait_timer = asyncio.get_running_loop().call_later(
                self.config.worker_wait_timeout, self._expire_waiting, state
            )

    def _cancel_wait_timer(self, state: InFlightRequest) -> None:
        if state.wait_timer is not None:
            state.wait_timer.cancel()
            state.wait_timer = None

    def _expire_waiting(self, state: InFlightRequest) -> None:
        state.wait_timer = None
        request_id = state.request_id
        if self.requests.get(request_id) is not state or state.worker_id is not None:
            return
        self.waiting.remove(request_id)
        state.fail(
            f"no worker attached within {self.config.worker_wait_timeout:g} s; "
            "start a worker (splitserve worker --scheduler HOST:PORT) and retry",
            code="UNAVAILABLE",
        )
        self._end(state)

    def _dispatch(self) -> None:
        """Hand requests from the head of the global queue to workers with room."""
        self.dispatcher.dispatch()

    def place(self, state: InFlightRequest, worker_id: str) -> bool:
        """On a step shard: run a request the leader placed on this worker (dispatcher.py)."""
        return self.dispatcher.place(state, worker_id)

    def _leave_session(self, state: InFlightRequest) -> WorkerSession | RemoteWorker | None:
        """Detach the request from its worker's bookkeeping (not from the core scheduler)."""
        wid = state.worker_id or ""
        session = self.sessions.get(wid) or self.remote_workers.get(wid)
        state.worker_id = None
        if session is not None:
            session.request_ids.discard(state.request_id)
            placement.remove_inflight(session.inflight_hashes, state.inflight_hashes)
            if state.lora_name:
                placement.remove_inflight(session.placed_loras, [state.lora_name])
        state.inflight_hashes = []
        return session

    def _shed(self, request: Request) -> None:
        """The policy ended a request that can no longer make a target (--shed-hopeless): 429 /
        RESOURCE_EXHAUSTED if it had no output yet, else 504 / DEADLINE_EXCEEDED
        (docs/scheduling.md); the message names the target missed."""
        rid = request.request_id
        state = self.requests.get(rid)
        if state is None:
            return
        self._leave_session(state)
        code = "DEADLINE_EXCEEDED" if state.output_token_ids else "RESOURCE_EXHAUSTED"
        target = request.missed_target or "deadline"
        state.fail(f"request {rid!r} can no longer meet its {target}: shed", code)
        self._end(state)

    def shed_hopeless_waiting(self) -> None:
        """Hopeless requests still in the global queue end as those in a worker's queue do
        (the policy's last re-plan says which; it re-plans in every worker's step)."""
        for request in self.policy.hopeless_waiting():
            if self.waiting.remove(request.request_id) is None:
                continue  # on a worker: its scheduler sheds it
            request.mark_shed(self.policy.missed_target(request))
            self._shed(request)

    def _end(self, state: InFlightRequest) -> None:
        """Bookkeeping once a request's stream has its last message."""
        self.requests.pop(state.request_id, None)
        if state.request_id in self._parked:
            self._unpark(state.request_id)
        self._cancel_wait_timer(state)
        state.finish_time = time.monotonic()
        self.num_finished += 1
        self.observer.on_request_finished(state)

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

    def _unpark(self, first_id: str) -> None:
        for sibling in self._parked.pop(first_id, ()):
            if sibling.core is not None and self.requests.get(sibling.request_id) is sibling:
                self.waiting.add(sibling.core)
                self._await_worker(sibling)
        self._dispatch()

    def _release(self, state: InFlightRequest) -> None:
        self.waiting.remove(state.request_id)
        parked = self._parked.get(state.prefill_after or "")
        if parked and state in parked:
            parked.remove(state)
        session = self._leave_session(state)
        if session is not None:
            session.cancel(state.request_id)
        self._dispatch()

    def _requeue(self, state: InFlightRequest, reason: str) -> None:
        """Back to the head of the global queue with the tokens it has (a lost or leaving
        worker); fails it once it has moved more than max_migrations times."""
        if self.requeue_to is not None:  # a step shard's: the leader's queue is the global one
            self.requests.pop(state.request_id, None)
            self._cancel_wait_timer(state)
            self.requeue_to(state, reason)
            return
        state.num_migrations += 1
        if state.num_migrations > self.config.max_migrations:
            state.fail(
                f"request lost its worker {state.num_migrations} times "
                f"(limit --max-migrations {self.config.max_migrations}); last: {reason}",
                code="UNAVAILABLE",
            )
            self._end(state)
            return
        request = state.to_core_request()
        state.core = request
        self.waiting.prepend(request)
        self._await_worker(state)

    # ---- workers (engine/worker_pool.py) and their step loops (engine/step_loop.py) -------
    def attach(self, registration: WorkerRegistration, transport: WorkerTransport) -> WorkerSession:
        return self.pool.attach(registration, transport)

    def detach(self, session: WorkerSession, reason: str) -> None:
        self.pool.detach(session, reason)

    def start_drain(self, session: WorkerSession, timeout_s: float) -> None:
        self.pool.start_drain(session, timeout_s)

    def finish_drain(self, session: WorkerSession) -> int:
        return self.pool.finish_drain(session)

    async def run_worker(self, session: WorkerSession) -> None:
        await self.steps.run_worker(session)

    # ---- introspection --------------------------------------------------------------------
    def server_info(self, max_model_len: int):
        return cluster_view.server_info(self, max_model_len)

    def worker_stats(self) -> list[tuple[WorkerSession, SchedulerStats]]:
        return [(s, s.scheduler.stats()) for s in self.sessions.values()]


def policy_options(config: SchedulerServiceConfig) -> dict[str, Any]:
    """Options every policy may take (each takes the ones it knows): aging rate, tenant
    weights (fair share; --tenants 'a:10,b:1')."""
    return {
        "aging_rate": config.aging_rate or None,
        "weights": parse_tenants(config.tenants) or None,
        "shed_hopeless": config.shed_hopeless,
    }
