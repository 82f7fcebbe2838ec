"""The leader's side of its step shards: the ShardLink service, and what the engine sees of
each shard's workers (RemoteWorker).

A shard's report is applied in one piece: its workers' state first (placement reads it), then
its requests' tokens, passed to their front-ends as the shard serialized them (the leader reads
no token), then the requests that ended and those handed back, then the tenants' computed
tokens for fair share. A shard whose stream breaks is lost: its requests are reclaimed from
their front-ends, which hold every token their clients got, and continue on other workers.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from common.convert import FINISH_FROM_PB
from common.logging import get_logger
from common.pb import frontend_link_pb2 as fl_pb
from common.pb import shard_link_pb2 as pb
from common.pb import shard_link_pb2_grpc as pb_grpc
from scheduler_svc.core import RequestStatus, SchedulerConfig
from scheduler_svc.engine.in_flight import InFlightRequest, to_submit
from scheduler_svc.engine.lora_registry import adapter_from_message
from scheduler_svc.shards.remote_worker import RemoteWorker

if TYPE_CHECKING:
    from scheduler_svc.engine.serving_engine import ServingEngine

log = get_logger("splitserve.shards")
HELLO_TIMEOUT_S = 30.0
# a lost shard's requests wait at most this long for their worker to attach to another shard
# with their rows (then they continue on them); after it, they go to any worker
REHOME_WAIT_S = 3.0


class ShardSession:
    """One connected shard: the commands for it, and its workers."""

    def __init__(
        self,
        hello: pb.ShardHello,
        epoch: Callable[[], int],
        on_assign: Callable[[InFlightRequest], None],
    ) -> None:
        self.shard_id = hello.shard_id
        self.host = hello.host
        self.pid = hello.pid
        self.worker_address = hello.worker_address
        self.workers: dict[str, RemoteWorker] = {}
        self.outbox: asyncio.Queue[pb.ShardCommand | None] = asyncio.Queue()
        self._epoch = epoch
        self._on_assign = on_assign  # fair share: the leader charges what it places

    def assign(self, worker_id: str, state: object) -> None:
        assert isinstance(state, InFlightRequest)
        self._on_assign(state)
        self.outbox.put_nowait(
            pb.ShardCommand(
                epoch=self._epoch(),
                assign=pb.AssignRequest(
                    worker_id=worker_id, frontend_id=state.frontend_id, request=to_submit(state)
                ),
            )
        )

    def cancel(self, request_id: str) -> None:
        self.outbox.put_nowait(
            pb.ShardCommand(epoch=self._epoch(), cancel=fl_pb.CancelRequest(request_id=request_id))
        )

    def close(self) -> None:
        self.outbox.put_nowait(None)


class ShardRouter:
    """The leader's shards and the requests it reclaims from a lost one's front-ends."""

    def __init__(self, engine: ServingEngine, epoch: Callable[[], int]) -> None:
        self.engine = engine
        self.epoch = epoch
        self.shards: dict[str, ShardSession] = engine.shard_links  # /cluster lists them too
        self.reclaiming: dict[str, tuple[InFlightRequest, str]] = {}  # -> (state, its worker)
        # reclaimed requests waiting for their lost shard's worker to attach elsewhere
        self.awaiting_worker: dict[str, list[InFlightRequest]] = {}

    # ---- a shard's report -----------------------------------------------------------------
    def apply(self, shard: ShardSession, report: pb.ShardReport) -> None:
        engine = self.engine
        gone = [w for w in report.workers if w.state == "gone"]
        for worker in report.workers:
            if worker.state != "gone":
                self._worker(shard, worker)
        frontends = engine.frontends
        for chunk in report.tokens:
            session = frontends.get(chunk.frontend_id)
            if session is not None:
                session.relay(chunk.token_batch)
        for request_id in report.first_token:
            state = engine.requests.get(request_id)
            if state is not None and state.first_token_time is None:
                state.first_token_time = state.last_token_time = time.monotonic()
                if request_id in engine._parked:
                    engine._unpark(request_id)
        for ended in report.ended:
            self._ended(shard, ended)
        for returned in report.returned:
            self._returned(shard, returned)
        for worker in gone:
            self._forget(shard, worker.worker_id, "detached from its shard")
        engine._dispatch()

    def _worker(self, shard: ShardSession, report: pb.ShardWorker) -> None:
        engine = self.engine
        remote = shard.workers.get(report.worker_id)
        if remote is None:
            other = engine.remote_workers.get(report.worker_id)
            other_shard = self.shards.get(other.shard_id) if other is not None else None
            if other_shard is not None:  # it moved here from another shard
                self._forget(other_shard, report.worker_id, "now on another shard")
            cfg = engine.config
            config = SchedulerConfig(
                max_num_batched_tokens=report.max_num_batched_tokens,
                max_num_seqs=report.max_num_seqs,
                block_size=report.block_size,
                num_blocks=report.num_device_blocks,
                max_model_len=report.max_model_len,
                enable_chunked_prefill=cfg.enable_chunked_prefill,
                enable_prefix_caching=report.enable_caching,
            )
            remote = RemoteWorker(report.worker_id, shard, config)
            shard.workers[report.worker_id] = remote
            engine.remote_workers[report.worker_id] = remote
            engine.worker_attached.set()
            for state in engine.requests.values():  # a worker takes them now
                engine._cancel_wait_timer(state)
            log.info("shard_worker_attached", shard_id=shard.shard_id, worker_id=report.worker_id)
        if report.held_request_ids:
            remote.held_request_ids = set(report.held_request_ids)
        self._release_awaiting(report.worker_id)
        remote.draining = report.state == "draining"
        remote.num_running = report.num_running
        remote.worst_waiting_priority = (
            report.worst_waiting_priority if report.num_waiting else None
        )
        remote.kv_usage = report.kv_usage
        remote.max_loras = report.max_loras
        if report.loras_changed:
            remote.available_loras = {a.name for a in report.loras}
            remote.resident_loras = set(report.resident_loras)
            engine.loras.learn([adapter_from_message(a) for a in report.loras])
        if report.cached_added or report.cached_removed or report.cached_reset:
            remote.apply_cache_report(
                list(report.cached_added), list(report.cached_removed), report.cached_reset
            )

    def _forget(self, shard: ShardSession, worker_id: str, reason: str) -> int:
        """The worker left the shard (or the shard is lost). Requests the leader still has on
        it (placed while the shard was reporting it gone: the shard sends those back, but from
        a worker the leader no longer knows) are reclaimed from their front-ends. Returns how
        many."""
        remote = shard.workers.pop(worker_id, None)
        if remote is None:
            return 0
        remote.lost = True
        if self.engine.remote_workers.get(worker_id) is remote:
            del self.engine.remote_workers[worker_id]
        log.info(
            "shard_worker_detached", shard_id=shard.shard_id, worker_id=worker_id, reason=reason
        )
        return self._reclaim(remote)

    def _reclaim(self, remote: RemoteWorker) -> int:
        engine = self.engine
        by_frontend: dict[str, list[str]] = defaultdict(list)
        for request_id in list(remote.request_ids):
            state = engine.requests.get(request_id)
            if state is None:
                continue
            engine._leave_session(state)
            self.reclaiming[request_id] = (state, remote.worker_id)
            by_frontend[state.frontend_id].append(request_id)
        for frontend_id, request_ids in by_frontend.items():
            session = engine.frontends.get(frontend_id)
            if session is None:
                for request_id in request_ids:
                    engine.drop(request_id)
                continue
            session.send(fl_pb.LeaderMessage(reclaim=fl_pb.Reclaim(request_ids=request_ids)))
        return sum(len(r) for r in by_frontend.values())

    def _mine(self, shard: ShardSession, request_id: str) -> InFlightRequest | None:
        state = self.engine.requests.get(request_id)
        if state is None or state.worker_id not in shard.workers:
            return None
        return state

    def _ended(self, shard: ShardSession, ended: pb.EndedRequest) -> None:
        state = self._mine(shard, ended.request_id)
        if state is None:
            return
        state.finish_reason = FINISH_FROM_PB.get(ended.finish_reason)
        sink = state.sink
        request_ids = getattr(sink, "request_ids", None)
        if request_ids is not None:
            request_ids.discard(state.request_id)
        self._settle(state, ended.num_output_tokens)
        self.engine._leave_session(state)
        self.engine._end(state)

    def _returned(self, shard: ShardSession, msg: fl_pb.SubmitRequest) -> None:
        """Its worker was lost (or gone before it arrived): back to the head of the queue
        with the tokens its client has."""
        state = self._mine(shard, msg.request_id)
        if state is None:
            return
        self.engine._leave_session(state)
        state.output_token_ids = list(msg.output_token_ids)
        self.engine._requeue(state, f"its worker on shard {shard.shard_id} left")

    # ---- fair share: the leader's queue is ordered by service the shards compute ----------
    def charge(self, state: InFlightRequest) -> None:
        """Placed: charged what it should compute in all, as a core charges a request the
        first time it schedules it."""
        if state.core is not None:
            self.engine.policy.account([state.core], [0])

    def _settle(self, state: InFlightRequest, num_output_tokens: int) -> None:
        policy = self.engine.policy
        request = state.core
        if not policy.accounts or request is None:
            return
        computed = len(request.prompt_token_ids) + num_output_tokens
        request.status = RequestStatus.FINISHED
        policy.account([request], [max(0, computed - len(request.output_token_ids))])

    # ---- a lost shard ---------------------------------------------------------------------
    def lost(self, shard: ShardSession, reason: str) -> None:
        """Every request on its workers is reclaimed from its front-end; the workers are
        forgotten (they attach again to another shard)."""
        if self.shards.get(shard.shard_id) is shard:
            del self.shards[shard.shard_id]
        reclaimed = 0
        loop = asyncio.get_running_loop()
        for worker_id in list(shard.workers):
            # its rows may come back with it, on another shard: its requests wait for it
            self.awaiting_worker.setdefault(worker_id, [])
            loop.call_later(REHOME_WAIT_S, self._release_awaiting, worker_id)
            reclaimed += self._forget(shard, worker_id, reason)
        log.warning("shard_lost", shard_id=shard.shard_id, reason=reason, reclaimed=reclaimed)
        self.engine._await_workers()

    def reclaimed(self, msg: fl_pb.SubmitRequest) -> None:
        """A front-end's answer to a Reclaim: the request goes on from the tokens it has, on
        its worker's rows if that worker attaches to another shard in time."""
        state, worker_id = self.reclaiming.pop(msg.request_id, (None, ""))
        if state is None or self.engine.requests.get(msg.request_id) is not state:
            return
        state.output_token_ids = list(msg.output_token_ids)
        awaiting = self.awaiting_worker.get(worker_id)
        if awaiting is not None and worker_id not in self.engine.remote_workers:
            awaiting.append(state)
            return
        self._requeue([state])

    def _release_awaiting(self, worker_id: str) -> None:
        """The worker attached again (or the wait is over): its reclaimed requests go to the
        head of the queue, where placement finds the rows it reported holding."""
        states = self.awaiting_worker.pop(worker_id, None)
        if states:
            self._requeue(states)

    def _requeue(self, states: list[InFlightRequest]) -> None:
        states = [s for s in states if self.engine.requests.get(s.request_id) is s]
        states.sort(key=lambda s: s.arrival_time, reverse=True)  # prepend: latest first
        for state in states:
            self.engine._requeue(state, "its step shard was lost")
        self.engine._dispatch()


class ShardLinkService(pb_grpc.ShardLinkServicer):
    def __init__(
        self, router: ShardRouter, scheduler_id: Callable[[], str], is_leader: Callable[[], bool]
    ) -> None:
        self.router = router
        self.scheduler_id = scheduler_id
        self.is_leader = is_leader

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        if not self.is_leader():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this scheduler is a standby, not the leader"
            )
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no ShardHello in time")
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message on a shard link must be ShardHello",
            )
        router = self.router
        shard = ShardSession(first.hello, router.epoch, router.charge)
        old = router.shards.get(shard.shard_id)
        if old is not None:
            old.close()
            router.lost(old, "replaced by a new connection with the same shard id")
        router.shards[shard.shard_id] = shard
        log.info("shard_attached", shard_id=shard.shard_id, host=shard.host, pid=shard.pid)
        await context.write(
            pb.ShardCommand(
                epoch=router.epoch(),
                hello_ack=pb.ShardHelloAck(scheduler_id=self.scheduler_id()),
            )
        )
        reader = asyncio.create_task(self._read(context, shard))
        try:
            while (command := await shard.outbox.get()) is not None:
                await context.write(command)
        finally:
            reader.cancel()
            if router.shards.get(shard.shard_id) is shard:
                router.lost(shard, "its link broke")

    async def _read(self, context, shard: ShardSession) -> None:
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                if msg.WhichOneof("msg") == "report":
                    self.router.apply(shard, msg.report)
        except Exception as exc:  # noqa: BLE001 - any stream failure means the shard is gone
            log.info("shard_stream_error", shard_id=shard.shard_id, error=str(exc))
        shard.close()
