"""One worker's step loop: schedule, send the diff, apply the sampled tokens, stream them to
each request's sink. With async scheduling step N+1 is scheduled and sent while the worker runs
step N. The hot path of the whole service: once per request per step in _deliver_step."""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from common.convert import TokenLogprobs
from common.logging import get_logger
from scheduler_svc.core import RequestOutput, SchedulerOutput
from scheduler_svc.core.remaining_work import StepFit
from scheduler_svc.engine.in_flight import InFlightRequest
from scheduler_svc.engine.worker_session import WorkerLost, WorkerSession

if TYPE_CHECKING:
    from scheduler_svc.engine.engine_host import EngineHost

log = get_logger("splitserve.engine")


class StepLoop:
    def __init__(self, engine: EngineHost) -> None:
        self.engine = engine

    async def run_worker(self, session: WorkerSession) -> None:
        """The step loop of one worker: schedule, execute remotely, apply. With async
        scheduling, step N+1 is scheduled and sent while the worker runs step N, so scheduling
        and the network hop hide behind the forward pass. Ends when the worker is lost or has
        drained."""
        sched = session.scheduler
        transport = session.transport
        depth = 2 if self.engine.config.async_scheduling else 1
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
                    if self.engine.waiting:  # refill the worker's queue that the last step drew on
                        self.engine._dispatch()
                    out = sched.schedule()
                    for shed in sched.take_shed():
                        self.engine._shed(shed)
                    self.engine.shed_hopeless_waiting()
                    if not _has_work(out):
                        after_pause = True
                        break
                    if not self.engine.may_act():  # a leader that lost its lease sends nothing
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
            if self.engine.pacer.adaptive and not uncounted:
                changed = self.engine.pacer.on_step(reply.idle_time_s, time.monotonic())
                if changed is not None:
                    self._set_stream_interval(changed)
            sched.note_worker_wait(out, reply.idle_time_s)
            outputs = sched.update_from_output(out, reply.sampled)
            self.engine.observer.on_step(session, out, reply, time.perf_counter() - started)
            self.engine.slo.on_step(sched, out, time.perf_counter() - started)
            self._measured_costs()
            self._deliver_step(session, outputs, reply.logprobs)

    def _measured_costs(self) -> None:
        """The policy's cost model follows the step time SLO admission fits and the live
        workers; a decode batch is taken as half of max_num_seqs full, as the simulator's
        scenarios do."""
        steps = self.engine.slo.steps
        if not self.engine.policy.uses_step_costs or not steps.ready:
            return
        workers = sum(1 for s in self.engine.sessions.values() if not s.lost)
        batch = max(1, self.engine.config.max_num_seqs // 2)
        self.engine.policy.measured(StepFit(*steps.coefficients()), batch, max(1, workers))

    def _set_stream_interval(self, interval: int) -> None:
        """Adaptive --stream-interval: every stream from now on (front-ends apart learn it
        from the cluster status)."""
        for listener in self.engine.pacing_listeners:
            listener(interval)
        log.info(
            "stream_interval_changed",
            interval=interval,
            worker_idle_ms=round(1e3 * self.engine.pacer.last_idle_avg_s, 3),
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
        requests = self.engine.requests
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
                if (
                    self.engine._parked and request_id in self.engine._parked
                ):  # prompt done: siblings go
                    self.engine._unpark(request_id)
            if stopped_by_string:
                session.scheduler.abort_request(request_id)
            if state.finish_reason is not None:
                ended.append(state)
        if delivered:
            self.engine.observer.on_tokens_batch(delivered, now)
        for state in ended:  # after the tokens are counted, as one request at a time was
            self.engine._leave_session(state)
            if session.draining:
                session.num_drained_finished += 1
            self.engine._end(state)


def _has_work(out: SchedulerOutput) -> bool:
    return bool(
        out.total_num_scheduled_tokens
        or out.finished_req_ids
        or out.preempted_req_ids
        or out.blocks_to_swap_out
    )
