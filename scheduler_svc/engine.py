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
from collections import deque
from collections.abc import Callable
from typing import Any

from common.convert import TokenLogprobs
from common.logging import get_logger
from scheduler_svc import cluster_view, placement, worker_limits
from scheduler_svc.admission import AdmissionControl, parse_tenant_seconds, parse_tenants
from scheduler_svc.config import SchedulerServiceConfig
from scheduler_svc.core import (
    FinishReason,
    Request,
    RequestOutput,
    RequestRejected,
    Scheduler,
    SchedulerOutput,
    SchedulerStats,
    create_policy,
    create_request_queue,
    validate_request,
)
from scheduler_svc.core.remaining_work import StepFit
from scheduler_svc.core.speculative import SpeculativeConfig
from scheduler_svc.in_flight import InFlightRequest
from scheduler_svc.observer import EngineObserver
from scheduler_svc.policy_control import set_priority
from scheduler_svc.slo import SloAdmission
from scheduler_svc.stream_pacing import StreamPacer
from scheduler_svc.worker_session import (
    WorkerLost,
    WorkerRegistration,
    WorkerSession,
    WorkerTransport,
)

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
        # a new leader rebuilding (scheduler_svc/takeover.py): nothing is dispatched until the
        # workers and front-ends of the old leader have reported what they hold
        self.rebuilding = False
        self._resumed: list[InFlightRequest] = []  # reported by front-ends during the rebuild
        self._held: dict[str, tuple[WorkerSession, Any]] = {}  # request id -> worker row
        self.may_act: Callable[[], bool] = lambda: True  # False once leadership is lost
        self._parked: dict[str, list[InFlightRequest]] = {}  # first of a group -> its siblings
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
        self.admission.check(state.tenant, len(self.waiting))
        tenant = state.tenant or ""
        if state.ttft_target_s is None:
            state.ttft_target_s = self.tenant_ttft.get(tenant)
        if state.tpot_target_s is None:
            state.tpot_target_s = self.tenant_tpot.get(tenant)
        request = state.to_core_request()
        live = self._live_sessions()
        if live:  # refuse now what even the largest worker could never run
            largest = max(live, key=lambda s: s.registration.num_device_blocks)
            validate_request(request, largest.scheduler.config)
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

    def resume(self, states: list[InFlightRequest]) -> int:
        """Requests a front-end had in flight when it (re)connected, with the tokens its
        clients already have: no admission checks (they were admitted once). During a takeover
        they wait for the rebuild; otherwise each continues on the KV its worker still holds
        or goes back to the head of the queue. Returns how many continue without recompute."""
        for state in states:  # the same request over an older link of this front-end
            self.drop(state.request_id)
        states = [s for s in states if not self._fail_impossible(s)]
        if self.rebuilding:
            ids = {s.request_id for s in states}
            self._resumed = [s for s in self._resumed if s.request_id not in ids] + states
            return 0
        return self._place_resumed(states)

    def owner(self, request_id: str) -> str | None:
        """Who has this request in flight: its front-end's id ("" for a client of this process),
        or None when nobody has (also while a takeover waits to place it)."""
        state = self.requests.get(request_id)
        if state is None:
            state = next((s for s in self._resumed if s.request_id == request_id), None)
        return None if state is None else state.frontend_id

    def begin_rebuild(self) -> None:
        self.rebuilding = True

    def finish_rebuild(self) -> tuple[int, int, int]:
        """End of a takeover's rebuild: adopt what the workers hold, queue the rest.
        Returns (requests resumed, of which adopted without recompute, tokens to recompute)."""
        states, self._resumed = self._resumed, []
        adopted = self._place_resumed(states)
        recomputed = sum(
            len(s.prompt_token_ids) + len(s.output_token_ids)
            for s in states
            if s.worker_id is None and s.finish_reason is None
        )
        self._held.clear()
        self.rebuilding = False
        self._dispatch()
        for session in self.sessions.values():
            session.wakeup.set()
        return len(states), adopted, recomputed

    def _place_resumed(self, states: list[InFlightRequest]) -> int:
        adopted = 0
        queued: list[InFlightRequest] = []
        for state in states:
            request = state.to_core_request()
            state.core = request
            self.requests[state.request_id] = state
            self.observer.on_request_accepted(state)
            if self._adopt(state, request):
                adopted += 1
            else:
                queued.append(state)
        queued.sort(key=lambda s: s.arrival_time, reverse=True)  # prepend: latest first
        for state in queued:
            assert state.core is not None
            self.waiting.prepend(state.core)
            self._await_worker(state)
        self._dispatch()
        return adopted

    def _adopt(self, state: InFlightRequest, request) -> bool:
        """Continue on the worker row that holds this request's KV (no recompute), when one
        reported it and its blocks fit the new leader's accounting."""
        session, row = self._held.pop(state.request_id, (None, None))
        if session is None or row is None or session.lost or session.draining:
            return False
        num_computed = min(row.num_computed_tokens, request.num_tokens - 1)
        try:
            session.scheduler.adopt_request(request, list(row.block_ids), num_computed)
        except ValueError as exc:
            log.warning("adopt_refused", request_id=state.request_id, reason=str(exc))
            return False
        state.worker_id = session.worker_id
        session.request_ids.add(state.request_id)
        session.wakeup.set()
        return True

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
        for what, ids in (("prompt", state.prompt_token_ids), ("output", state.output_token_ids)):
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
        return any(s.accepting for s in self.sessions.values())

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
        if self.rebuilding:
            return
        depth = self.config.worker_queue_depth
        while self.waiting:
            eligible = [  # each within its own rows (the smaller of ours and the worker's)
                s
                for s in self.sessions.values()
                if s.accepting
                and len(s.scheduler.waiting) < depth
                and s.load < s.scheduler.config.max_num_seqs + depth
            ]
            if not eligible:
                return
            request = self.waiting.pop()
            state = self.requests[request.request_id]
            choice = placement.choose(request, eligible, self.placement)
            session = choice.session
            try:
                session.scheduler.add_request(request)
            except RequestRejected as exc:
                state.fail(str(exc), code="INVALID_ARGUMENT")
                self._end(state)
                continue
            self._cancel_wait_timer(state)
            state.worker_id = session.worker_id
            session.request_ids.add(state.request_id)
            kv = session.scheduler.kv
            state.inflight_hashes = list(
                kv.block_hashes(request, (request.num_tokens - 1) // kv.block_size)
            )
            placement.add_inflight(session, state.inflight_hashes)
            session.wakeup.set()
            log.info(
                "request_placed",
                request_id=state.request_id,
                worker_id=session.worker_id,
                reason=choice.reason,
                prefix_tokens=choice.prefix_tokens,
                load=choice.load,
                migrations=state.num_migrations,
            )

    def _leave_session(self, state: InFlightRequest) -> WorkerSession | None:
        """Detach the request from its worker's bookkeeping (not from the core scheduler)."""
        session = self.sessions.get(state.worker_id or "")
        state.worker_id = None
        if session is not None:
            session.request_ids.discard(state.request_id)
            placement.remove_inflight(session.inflight_hashes, state.inflight_hashes)
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
            session.scheduler.abort_request(state.request_id)
            session.wakeup.set()
        self._dispatch()

    def _requeue(self, state: InFlightRequest, reason: str) -> None:
        """Back to the head of the global queue with the tokens it has (a lost or leaving
        worker); fails it once it has moved more than max_migrations times."""
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

    # ---- workers --------------------------------------------------------------------------
    def attach(self, registration: WorkerRegistration, transport: WorkerTransport) -> WorkerSession:
        old = self.sessions.get(registration.worker_id)
        if old is not None:
            self.detach(old, "replaced by a new connection with the same worker id")
        sched_cfg = worker_limits.scheduler_config(self.config, registration, self._speculative)
        # every worker's local queue orders with the engine's policy object, so policy state
        # (aging, per-tenant service) is global
        local_queue = create_request_queue(self.policy)
        session = WorkerSession(registration, Scheduler(sched_cfg, local_queue), transport)
        self.sessions[registration.worker_id] = session
        if self.rebuilding:
            for row in getattr(registration, "held", ()):
                self._held[row.request_id] = (session, row)
        self.worker_attached.set()
        for state in self.requests.values():  # a worker takes them now: none waits for one
            self._cancel_wait_timer(state)
        self.observer.on_worker_attached(session)
        log.info(
            "worker_attached",
            worker_id=registration.worker_id,
            num_blocks=registration.num_device_blocks,
            block_size=registration.block_size,
            address=registration.address,
        )
        self._dispatch()
        return session

    def detach(self, session: WorkerSession, reason: str) -> None:
        """The worker is gone: its unfinished requests go back to the global queue. Once per
        session: a worker that registers again under its id (restarted by `splitserve up`)
        while its old link still looks open replaces the old session here in `attach`, and the
        old link's end must not then detach the new session's metrics and history."""
        session.mark_lost(reason)
        if self.sessions.get(session.worker_id) is not session:
            return
        del self.sessions[session.worker_id]
        if not self._live_sessions():
            self.worker_attached.clear()
        moved = self._hand_back(session, session.request_ids, reason)
        self._await_workers()
        self.observer.on_worker_detached(session, reason)
        log.warning("worker_detached", worker_id=session.worker_id, reason=reason, migrated=moved)
        self._dispatch()

    def _hand_back(self, session: WorkerSession, request_ids, reason: str) -> int:
        """Move these requests of `session` back to the head of the global queue, keeping
        their relative order (the first to run goes first)."""
        states = [self.requests[r] for r in request_ids if r in self.requests]
        states.sort(key=lambda s: s.arrival_time, reverse=True)  # prepend: latest first
        for state in states:
            self._leave_session(state)
            if not session.lost:
                session.scheduler.abort_request(state.request_id)
            self._requeue(state, reason)
        return len(states)

    def start_drain(self, session: WorkerSession, timeout_s: float) -> None:
        """The worker is leaving: no new requests; local waiting ones go elsewhere now, running
        ones get until the deadline to finish."""
        if session.draining or session.lost:
            return
        session.draining = True
        session.drain_deadline = time.monotonic() + max(0.0, timeout_s)
        waiting_ids = [r.request_id for r in session.scheduler.waiting]
        moved = self._hand_back(session, waiting_ids, "worker draining")
        self._await_workers()
        log.info(
            "worker_draining",
            worker_id=session.worker_id,
            timeout_s=timeout_s,
            running=session.load,
            handed_back=moved,
        )
        session.wakeup.set()
        self._dispatch()

    def finish_drain(self, session: WorkerSession) -> int:
        """At the deadline (or when empty): hand back whatever still runs. Returns how many."""
        moved = self._hand_back(session, list(session.request_ids), "worker drain deadline")
        self._dispatch()
        return moved

    async def run_worker(self, session: WorkerSession) -> None:
        """The step loop of one worker: schedule, execute remotely, apply. With async
        scheduling, step N+1 is scheduled and sent while the worker runs step N, so scheduling
        and the network hop hide behind the forward pass. Ends when the worker is lost or has
        drained."""
        sched = session.scheduler
        transport = session.transport
        depth = 2 if self.config.async_scheduling else 1
        inflight: deque = deque()
        # A step sent after a moment with nothing to schedule runs alone: requests of a burst
        # still arriving join the next step instead of a pipelined one scheduled a moment after
        # the first (requests sent at once reach the scheduler spread over some milliseconds). The
        # worker's wait before such a step, and before the one that waited on its result, is
        # not time the scheduler added: neither counts for the adaptive stream interval.
        after_pause = True
        after_alone = False
        while not session.lost:
            leaving = session.draining and (
                not session.request_ids or time.monotonic() >= session.drain_deadline
            )
            if leaving and not inflight:
                return
            try:
                while not leaving and len(inflight) < (1 if inflight and inflight[0][3] else depth):
                    if self.waiting:  # refill the worker's queue that the last step drew on
                        self._dispatch()
                    out = sched.schedule()
                    for shed in sched.take_shed():
                        self._shed(shed)
                    self.shed_hopeless_waiting()
                    if not _has_work(out):
                        after_pause = True
                        break
                    if not self.may_act():  # a leader that lost its lease sends nothing
                        session.mark_lost("this scheduler is no longer the leader")
                        return
                    started = time.perf_counter()
                    handle = await transport.submit(out)
                    inflight.append((out, handle, started, after_pause, after_pause or after_alone))
                    after_pause = after_alone = False
                if not inflight:
                    if not leaving:
                        await self._idle(session)
                    continue
                out, handle, started, alone, uncounted = inflight.popleft()
                after_alone = alone
                reply = await transport.result(out, handle)
            except WorkerLost as exc:
                session.mark_lost(str(exc))
                return
            if session.lost:
                return
            session.num_steps += 1
            session.last_forward_time_s = reply.forward_time_s
            session.total_worker_step_s += reply.step_time_s
            session.total_worker_idle_s += reply.idle_time_s
            if self.pacer.adaptive and not uncounted:
                changed = self.pacer.on_step(reply.idle_time_s, time.monotonic())
                if changed is not None:
                    self._set_stream_interval(changed)
            sched.note_worker_wait(out, reply.idle_time_s)
            outputs = sched.update_from_output(out, reply.sampled)
            self.observer.on_step(session, out, reply, time.perf_counter() - started)
            self.slo.on_step(sched, out, time.perf_counter() - started)
            self._measured_costs()
            self._deliver_step(session, outputs, reply.logprobs)

    def _measured_costs(self) -> None:
        """The policy's cost model follows the step time SLO admission fits and the live
        workers; a decode batch is taken as half of max_num_seqs full, as the simulator's
        scenarios do."""
        steps = self.slo.steps
        if not self.policy.uses_step_costs or not steps.ready:
            return
        workers = sum(1 for s in self.sessions.values() if not s.lost)
        batch = max(1, self.config.max_num_seqs // 2)
        self.policy.measured(StepFit(*steps.coefficients()), batch, max(1, workers))

    def _set_stream_interval(self, interval: int) -> None:
        """Adaptive --stream-interval: every stream from now on (front-ends apart learn it
        from the cluster status)."""
        for listener in self.pacing_listeners:
            listener(interval)
        log.info(
            "stream_interval_changed",
            interval=interval,
            worker_idle_ms=round(1e3 * self.pacer.last_idle_avg_s, 3),
        )

    async def _idle(self, session: WorkerSession) -> None:
        """Nothing to send: wait for a new request, an abort, a drain deadline or loss."""
        session.wakeup.clear()
        timeout = 0.05 if session.scheduler.has_unfinished_requests() else None
        if session.draining:
            timeout = max(0.0, session.drain_deadline - time.monotonic())
        try:
            await asyncio.wait_for(session.wakeup.wait(), timeout)
        except TimeoutError:
            pass

    def _deliver_step(
        self,
        session: WorkerSession,
        outputs: list[RequestOutput],
        logprobs: dict[str, list[TokenLogprobs]],
    ) -> None:
        """Stream one step's outputs to their requests (the hot path: once per request per
        step), then tell the observer about all the step's tokens at once."""
        now = time.monotonic()
        requests = self.requests
        worker_id = session.worker_id
        get_logprobs = logprobs.get if logprobs else None
        delivered: list[tuple[InFlightRequest, int]] = []
        ended: list[InFlightRequest] = []
        for output in outputs:
            request_id = output.request_id
            state = requests.get(request_id)
            if state is None or state.worker_id != worker_id:
                continue
            new_ids = output.new_token_ids
            if output.finish_reason is None and get_logprobs is None and len(new_ids) == 1:
                stopped_by_string = state.push_token(new_ids, now)
            else:
                stopped_by_string = state.push_tokens(
                    new_ids,
                    output.finish_reason,
                    output.stop_reason,
                    get_logprobs(request_id) if get_logprobs is not None else None,
                    now,
                )
            if new_ids:
                delivered.append((state, len(new_ids)))
                if self._parked and request_id in self._parked:  # prompt done: siblings go
                    self._unpark(request_id)
            if stopped_by_string:
                session.scheduler.abort_request(request_id)
            if state.finish_reason is not None:
                ended.append(state)
        if delivered:
            self.observer.on_tokens_batch(delivered, now)
        for state in ended:  # after the tokens are counted, as one request at a time was
            self._leave_session(state)
            if session.draining:
                session.num_drained_finished += 1
            self._end(state)

    async def change_priority(self, request_id: str, priority: int) -> None:
        """As policy_control.set_priority (the client APIs await it: a front-end's engine asks
        the leader)."""
        set_priority(self, request_id, priority)

    # ---- introspection --------------------------------------------------------------------
    def server_info(self, max_model_len: int):
        return cluster_view.server_info(self, max_model_len)

    def worker_stats(self) -> list[tuple[WorkerSession, SchedulerStats]]:
        return [(s, s.scheduler.stats()) for s in self.sessions.values()]


def _has_work(out: SchedulerOutput) -> bool:
    return bool(
        out.total_num_scheduled_tokens
        or out.finished_req_ids
        or out.preempted_req_ids
        or out.blocks_to_swap_out
    )


def policy_options(config: SchedulerServiceConfig) -> dict[str, Any]:
    """Options every policy may take (each takes the ones it knows): aging rate, tenant
    weights (fair share; --tenants 'a:10,b:1')."""
    return {
        "aging_rate": config.aging_rate or None,
        "weights": parse_tenants(config.tenants) or None,
        "shed_hopeless": config.shed_hopeless,
    }
