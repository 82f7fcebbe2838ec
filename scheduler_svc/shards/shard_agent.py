"""A step shard's side of the ShardLink: it dials the leader, runs the requests the leader
places on its workers, and reports once per turn of its event loop.

The shard's engine is the ServingEngine of a single scheduler with an empty global queue: the
leader's queue is the global one. What the shard's workers' steps produce goes into one report
(shard_link.proto): each front-end's updates packed as the leader would pack them, so the
leader passes them on unread; the requests that ended; those whose worker was lost, with the
tokens their clients have, for the leader's queue; the workers whose state changed, with their
prefix cache's changes (block_pool.CacheJournal).

When the link to the leader breaks, the shard drops every request it runs (their front-ends
resubmit them to whoever leads, with their tokens) and dials again.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable

import grpc

from common.convert import FINISH_TO_PB
from common.logging import get_logger
from common.outcomes import FinishReason, RequestRejected
from common.pb import frontend_link_pb2 as fl_pb
from common.pb import shard_link_pb2 as pb
from common.pb import shard_link_pb2_grpc as pb_grpc
from scheduler_svc.core import CacheJournal, KVCacheManager, Request, SamplingParams
from scheduler_svc.engine.in_flight import InFlightRequest, from_submit, to_submit
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.engine.worker_session import WorkerSession
from scheduler_svc.ha.cluster_view import lora_message
from scheduler_svc.links.frontend_link import PackedSink
from scheduler_svc.obs.engine_observer import EngineObserver

log = get_logger("splitserve.shard")
RETRY_S = 0.5
HELD_KEEP_S = 10.0  # rows a worker brought along wait this long for their requests


class RelaySink(PackedSink):
    """Where a shard's requests from one front-end send their news: into the next report."""

    def __init__(self, agent: ShardAgent, frontend_id: str) -> None:
        super().__init__()
        self.agent = agent
        self.frontend_id = frontend_id

    def _batch_opened(self) -> None:
        self.agent.pending_tokens.append(self)
        self.agent.soon()

    def _noted(self, request_id: str, start: int, token_ids: list[int], finished: bool) -> None:
        if start == 0 and token_ids:
            self.agent.report.first_token.append(request_id)

    def take(self) -> bytes:
        """The TokenBatch built since the last take, serialized."""
        batch = self.take_batch()
        packed = fl_pb.TokenBatch()
        if batch is not None:
            batch.into(packed)
        return packed.SerializeToString()


class ShardAgent(EngineObserver):
    def __init__(
        self,
        engine: ServingEngine,
        shard_id: str,
        worker_address: str,
        channel: Callable[[str], grpc.aio.Channel],
        on_epoch: Callable[[int], None],
    ) -> None:
        self.engine = engine
        self.shard_id = shard_id
        self.worker_address = worker_address
        self.channel = channel  # address -> a channel to the leader's internal port
        self.on_epoch = on_epoch
        self.sinks: dict[str, RelaySink] = {}
        # request id -> (the pool, a placeholder holding the blocks of a row brought along)
        self.reserved: dict[str, tuple[KVCacheManager, Request]] = {}
        self.pending_tokens: list[RelaySink] = []
        self.report = pb.ShardReport()
        self.dirty_workers: set[str] = set()
        self._loras_sent: dict[str, tuple[list[str], list[str]]] = {}  # as last described
        self.gone_workers: list[str] = []
        self.outbox: asyncio.Queue[pb.ShardMessage] | None = None
        self._flush_scheduled = False
        self.connected = asyncio.Event()
        engine.requeue_to = self._returned
        engine.keeps_held_rows = True

    # ---- the engine's events --------------------------------------------------------------
    def on_worker_attached(self, session: WorkerSession) -> None:
        pool = session.scheduler.kv.pool
        pool.journal = CacheJournal(pool.cached)
        self._loras_sent.pop(session.worker_id, None)  # the leader's record of it is new
        self.dirty_workers.add(session.worker_id)
        rows = [(r, row) for r, (s, row) in self.engine._held.items() if s is session]
        for request_id, row in rows:
            self._reserve(session, request_id, row)
        if rows:
            asyncio.get_running_loop().call_later(HELD_KEEP_S, self._forget_held, session)
        self.soon()

    def _reserve(self, session: WorkerSession, request_id: str, row) -> None:  # noqa: ANN001
        """Hold the blocks of a row the worker brought along until its request is placed back
        (or HELD_KEEP_S): the pool must not hand them to others and overwrite that KV."""
        kv = session.scheduler.kv
        placeholder = Request(f"held:{request_id}", [0], SamplingParams(max_tokens=1))
        num_blocks = -(-row.num_computed_tokens // kv.block_size)
        try:
            kv.adopt(placeholder, list(row.block_ids), num_blocks)
        except ValueError as exc:
            log.warning("held_row_refused", request_id=request_id, reason=str(exc))
            self.engine._held.pop(request_id, None)
            return
        self.reserved[request_id] = (kv, placeholder)

    def _release(self, request_id: str) -> None:
        reserved = self.reserved.pop(request_id, None)
        if reserved is not None:
            kv, placeholder = reserved
            kv.free(placeholder)

    def _forget_held(self, session: WorkerSession) -> None:
        held = self.engine._held
        for request_id in [r for r, (s, _) in held.items() if s is session]:
            del held[request_id]
            self._release(request_id)

    def on_worker_detached(self, session: WorkerSession, reason: str) -> None:
        self.dirty_workers.discard(session.worker_id)
        self.gone_workers.append(session.worker_id)
        self.soon()

    def on_step(self, session, out, reply, elapsed_s) -> None:  # noqa: ANN001
        self.dirty_workers.add(session.worker_id)
        self.soon()

    def on_request_finished(self, state: InFlightRequest) -> None:
        reason = state.finish_reason or FinishReason.ABORT
        self.report.ended.add(
            request_id=state.request_id,
            finish_reason=FINISH_TO_PB[reason],
            num_output_tokens=len(state.output_token_ids),
        )
        self.soon()

    def _returned(self, state: InFlightRequest, reason: str) -> None:
        self.report.returned.append(to_submit(state))
        log.info("request_returned", request_id=state.request_id, reason=reason)
        self.soon()

    # ---- the report -----------------------------------------------------------------------
    def soon(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        report = self.report
        for sink in self.pending_tokens:
            report.tokens.add(frontend_id=sink.frontend_id, token_batch=sink.take())
        self.pending_tokens.clear()
        sessions = self.engine.sessions
        for worker_id in self.dirty_workers:
            session = sessions.get(worker_id)
            if session is not None:
                self._describe(session, report.workers.add())
        self.dirty_workers.clear()
        for worker_id in self.gone_workers:
            report.workers.add(worker_id=worker_id, state="gone")
        self.gone_workers.clear()
        self.report = pb.ShardReport()
        if self.outbox is not None and report.ByteSize():
            self.outbox.put_nowait(pb.ShardMessage(report=report))

    def _describe_loras(self, session: WorkerSession, into: pb.ShardWorker) -> None:
        """Its adapters read and in slots, only when they changed since the leader last heard
        (a worker is described after each of its steps)."""
        now = (sorted(session.available_loras), sorted(session.resident_loras))
        if self._loras_sent.get(session.worker_id) == now:
            return
        self._loras_sent[session.worker_id] = now
        known = self.engine.loras.adapters
        into.loras.extend(lora_message(known[n]) for n in now[0] if n in known)
        into.resident_loras.extend(now[1])
        into.loras_changed = True

    def _describe(self, session: WorkerSession, into: pb.ShardWorker) -> None:
        sched = session.scheduler
        cfg = sched.config
        pool = sched.kv.pool
        into.worker_id = session.worker_id
        into.state = session.state if not session.lost else "gone"
        into.block_size = cfg.block_size
        into.num_device_blocks = cfg.num_blocks
        into.max_model_len = cfg.max_model_len
        into.max_num_seqs = cfg.max_num_seqs
        into.max_num_batched_tokens = cfg.max_num_batched_tokens
        into.num_waiting = len(sched.waiting)
        worst = session.worst_waiting_priority
        into.worst_waiting_priority = 0 if worst is None else worst
        into.num_running = len(sched.running)
        into.kv_usage = pool.usage
        into.enable_caching = cfg.enable_prefix_caching
        if session.max_loras > 0:
            into.max_loras = session.max_loras
            self._describe_loras(session, into)
        journal = pool.journal
        if journal is not None:
            if journal.reset:  # its first report here
                into.held_request_ids.extend(
                    r for r, (s, _) in self.engine._held.items() if s is session
                )
            added, removed, reset = journal.take()
            into.cached_added.extend(added)
            into.cached_removed.extend(removed)
            into.cached_reset = reset

    # ---- the leader's commands ------------------------------------------------------------
    def _assign(self, msg: pb.AssignRequest) -> None:
        sink = self.sinks.get(msg.frontend_id)
        if sink is None:
            sink = self.sinks[msg.frontend_id] = RelaySink(self, msg.frontend_id)
        try:
            state = from_submit(msg.request, sink, msg.frontend_id)
        except RequestRejected as exc:  # the leader checked it: only a mismatch of versions
            log.warning("assign_refused", request_id=msg.request.request_id, error=str(exc))
            self.report.ended.add(
                request_id=msg.request.request_id, finish_reason=FINISH_TO_PB[FinishReason.ERROR]
            )
            self.soon()
            return
        state.prefill_after = None  # the leader held it back as long as needed
        self._release(state.request_id)  # its held blocks: adopted in the same call
        if not self.engine.place(state, msg.worker_id):
            self._returned(state, f"worker {msg.worker_id!r} is not on this shard")
            return
        self.dirty_workers.add(msg.worker_id)  # its local queue, as the leader must see it
        self.soon()

    def _cancel(self, request_id: str) -> None:
        self.engine.drop(request_id)

    # ---- the link -------------------------------------------------------------------------
    async def run(self, leaders: asyncio.Queue[str]) -> None:
        """Follow the leader: each address from `leaders` (a fixed one, or etcd's) is dialed
        until the next one comes."""
        address = await leaders.get()
        while True:
            link = asyncio.create_task(self._link(address))
            change = asyncio.create_task(leaders.get())
            done, _ = await asyncio.wait({link, change}, return_when=asyncio.FIRST_COMPLETED)
            if change in done:
                link.cancel()
                await asyncio.gather(link, return_exceptions=True)
                address = change.result()
            else:
                change.cancel()
                await asyncio.sleep(RETRY_S)
            self._drop_all("the link to the leader ended")

    async def _link(self, address: str) -> None:
        channel = self.channel(address)
        try:
            call = pb_grpc.ShardLinkStub(channel).Connect()
            hello = pb.ShardHello(
                shard_id=self.shard_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                worker_address=self.worker_address,
            )
            await call.write(pb.ShardMessage(hello=hello))
            first = await call.read()
            if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello_ack":
                log.warning("shard_hello_refused", leader=address)
                return
            self.on_epoch(first.epoch)
            self.outbox = asyncio.Queue()
            self._loras_sent.clear()  # a new leader hears every worker's adapters
            for worker_id in self.engine.sessions:  # the first report: every worker
                self.dirty_workers.add(worker_id)
            self.soon()
            self.connected.set()
            log.info("shard_linked", leader=address, epoch=first.epoch)
            writer = asyncio.create_task(self._write(call, self.outbox))
            try:
                while (msg := await call.read()) is not grpc.aio.EOF:
                    kind = msg.WhichOneof("msg")
                    if kind == "assign":
                        self._assign(msg.assign)
                    elif kind == "cancel":
                        self._cancel(msg.cancel.request_id)
            finally:
                writer.cancel()
        except grpc.aio.AioRpcError as exc:
            log.info("shard_link_error", leader=address, error=exc.details() or str(exc.code()))
        finally:
            self.connected.clear()
            self.outbox = None
            await channel.close()

    @staticmethod
    async def _write(call, outbox: asyncio.Queue[pb.ShardMessage]) -> None:
        while True:
            await call.write(await outbox.get())

    def _drop_all(self, reason: str) -> None:
        """Without a leader nobody hears these requests' tokens: free them; their front-ends
        resubmit them to the leader they find next."""
        dropped = list(self.engine.requests)
        for request_id in dropped:
            self.engine.drop(request_id)
        self.report = pb.ShardReport()
        self.pending_tokens.clear()
        for sink in self.sinks.values():
            sink.take_batch()
        if dropped:
            log.warning("shard_dropped_requests", reason=reason, dropped=len(dropped))
