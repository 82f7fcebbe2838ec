"""gRPC adapter for front-end processes: tokenized requests in, token ids out, one stream each.

A front-end says hello with every request it has in flight (after a takeover, the new leader
rebuilds from these and from what the workers still hold); then submits and cancels. The leader
puts each step's new tokens for one front-end into one TokenBatch, and sends the cluster status
once a second. A broken stream means the front-end is gone: its requests are dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from common.convert import FINISH_TO_PB, TokenLogprobs
from common.link_auth import FRONTEND_ID_METADATA
from common.logging import get_logger
from common.outcomes import FinishReason, PriorityChangeError, RequestRejected, error_code
from common.pb import frontend_link_pb2 as pb
from common.pb import frontend_link_pb2_grpc as pb_grpc
from common.pb import generation_pb2 as gen_pb
from scheduler_svc.engine.in_flight import InFlightRequest, from_submit
from scheduler_svc.engine.priority_change import set_priority
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.ha.cluster_view import SchedulerRole, cluster_status
from scheduler_svc.links.lora_rpcs import LoraAdapterRpcs
from scheduler_svc.shards.shard_router import ShardRouter

log = get_logger("splitserve.frontend_link")
HELLO_TIMEOUT_S = 30.0
STATUS_INTERVAL_S = 1.0


class PackedSink:
    """An UpdateSink that packs its requests' news into one PackedBatch per turn of the loop.
    Subclasses say what opening a batch starts (_batch_opened) and what each piece of news
    means to them (_noted)."""

    closed = False

    def __init__(self) -> None:
        self._batch: PackedBatch | None = None

    def _open_batch(self) -> PackedBatch:
        batch = self._batch
        if batch is None:
            batch = self._batch = PackedBatch()
            self._batch_opened()
        return batch

    def _batch_opened(self) -> None:
        """A turn's first news: arrange for the batch to leave."""

    def _noted(self, request_id: str, start: int, token_ids: list[int], finished: bool) -> None:
        """After an update (not after add_next_token's usual news)."""

    def add_update(
        self,
        request_id: str,
        start: int,
        token_ids: list[int],
        finish_reason: FinishReason | None = None,
        stop_reason: str = "",
        logprobs: list[TokenLogprobs] | None = None,
        error: str = "",
        error_code: str = "",
        worker_id: str = "",
        retry_after_s: float = 0.0,
    ) -> bool:
        """Queue one request's news; everything queued in one turn of the loop (a step's
        deliveries) leaves as one message. Stop strings are the front-end's: it cancels."""
        if self.closed:
            return False
        self._open_batch().add_update(
            request_id,
            start,
            token_ids,
            finish_reason,
            stop_reason,
            logprobs,
            error,
            error_code,
            worker_id,
            retry_after_s,
        )
        self._noted(request_id, start, token_ids, finish_reason is not None)
        return False

    def add_next_token(self, request_id: str, start: int, token_id: int) -> bool:
        """add_update for the usual news: one more token, the request goes on."""
        if not self.closed:
            self._open_batch().add_next_token(request_id, start, token_id)
        return False

    def take_batch(self) -> PackedBatch | None:
        batch, self._batch = self._batch, None
        return batch


class FrontendSession(PackedSink):
    """One front-end's stream as the engine sees it: where its requests' tokens go."""

    def __init__(self, hello: pb.FrontendHello, epoch: Callable[[], int]) -> None:
        super().__init__()
        self.frontend_id = hello.frontend_id
        self.host = hello.host
        self.pid = hello.pid
        self.http_address = hello.http_address
        self.grpc_address = hello.grpc_address
        self.request_ids: set[str] = set()
        # messages, or LeaderMessages already serialized (relayed from a step shard)
        self.outbox: asyncio.Queue[pb.LeaderMessage | bytes | None] = asyncio.Queue()
        self._epoch = epoch
        self.closed = False

    def _batch_opened(self) -> None:
        asyncio.get_running_loop().call_soon(self._flush)

    def _noted(self, request_id: str, start: int, token_ids: list[int], finished: bool) -> None:
        if finished:
            self.request_ids.discard(request_id)

    def relay(self, token_batch: bytes) -> None:
        """A step shard's updates for this front-end, serialized there: passed on unread (a
        LeaderMessage written around the bytes), after whatever this process queued before."""
        if self.closed:
            return
        self._flush()
        self.outbox.put_nowait(
            b"\x08" + _varint(self._epoch()) + b"\x1a" + _varint(len(token_batch)) + token_batch
        )

    def _flush(self) -> None:
        batch = self.take_batch()
        if batch is not None and not self.closed:
            message = pb.LeaderMessage(epoch=self._epoch())
            batch.into(message.tokens)
            self.outbox.put_nowait(message)

    def send(self, message: pb.LeaderMessage) -> None:
        if not self.closed:
            message.epoch = self._epoch()
            self.outbox.put_nowait(message)

    def close(self) -> None:
        self.closed = True
        self.outbox.put_nowait(None)


class PackedBatch:
    """One front-end's news of one turn of the loop, being built: the usual one-more-token news
    as plain lists (written as TokenBatch's columns at the end, in C), the rest as updates. A
    request's news goes to the updates from its first update on, so that a receiver applying
    the columns first sees each request's tokens in order."""

    __slots__ = ("request_ids", "starts", "token_ids", "updates", "in_updates")

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.starts: list[int] = []
        self.token_ids: list[int] = []
        self.updates = pb.TokenBatch()
        self.in_updates: set[str] = set()

    def add_next_token(self, request_id: str, start: int, token_id: int) -> None:
        if request_id in self.in_updates:
            add_update_to(self.updates, request_id, start, [token_id])
            return
        self.request_ids.append(request_id)
        self.starts.append(start)
        self.token_ids.append(token_id)

    def add_update(self, request_id: str, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        self.in_updates.add(request_id)
        add_update_to(self.updates, request_id, *args, **kwargs)

    def __bool__(self) -> bool:
        return bool(self.request_ids) or bool(self.in_updates)

    def into(self, batch: pb.TokenBatch) -> None:
        """Write it all into `batch` (empty)."""
        batch.CopyFrom(self.updates)
        batch.next_request_ids.extend(self.request_ids)
        batch.next_starts.extend(self.starts)
        batch.next_token_ids.extend(self.token_ids)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _serialize_leader_message(message: pb.LeaderMessage | bytes) -> bytes:
    return message if isinstance(message, bytes) else message.SerializeToString()


def add_frontend_link(servicer: FrontendLinkService, server: grpc.aio.Server) -> None:
    """As the generated add_FrontendLinkServicer_to_server, with a stream that also takes
    LeaderMessages already serialized (FrontendSession.relay)."""
    handlers = {
        "Connect": grpc.stream_stream_rpc_method_handler(
            servicer.Connect,
            request_deserializer=pb.FrontendMessage.FromString,
            response_serializer=_serialize_leader_message,
        ),
        "SetPriority": grpc.unary_unary_rpc_method_handler(
            servicer.SetPriority,
            request_deserializer=gen_pb.SetPriorityRequest.FromString,
            response_serializer=gen_pb.SetPriorityResponse.SerializeToString,
        ),
        "LoadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.LoadLoraAdapter,
            request_deserializer=pb.LoadLoraAdapterRequest.FromString,
            response_serializer=gen_pb.LoraAdapter.SerializeToString,
        ),
        "UnloadLoraAdapter": grpc.unary_unary_rpc_method_handler(
            servicer.UnloadLoraAdapter,
            request_deserializer=pb.UnloadLoraAdapterRequest.FromString,
            response_serializer=pb.UnloadLoraAdapterResponse.SerializeToString,
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["FrontendLink"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)


def add_update_to(
    batch: pb.TokenBatch,
    request_id: str,
    start: int,
    token_ids: list[int],
    finish_reason: FinishReason | None = None,
    stop_reason: str = "",
    logprobs: list[TokenLogprobs] | None = None,
    error: str = "",
    error_code: str = "",
    worker_id: str = "",
    retry_after_s: float = 0.0,
) -> None:
    """One request's news as a RequestUpdate of `batch` (here, and on a step shard)."""
    update = batch.updates.add(
        request_id=request_id,
        start=start,
        token_ids=token_ids,
        finish_reason=FINISH_TO_PB[finish_reason],
        stop_reason=stop_reason,
        error=error,
        error_code=error_code,
        worker_id=worker_id,
        retry_after_s=retry_after_s,
    )
    for lp in logprobs or ():
        entry = update.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for tok, value in lp.top:
            entry.top.add(token_id=tok, logprob=value)


class FrontendLinkService(LoraAdapterRpcs, pb_grpc.FrontendLinkServicer):
    def __init__(
        self,
        engine: ServingEngine,
        role: SchedulerRole,
        max_model_len: int,
        is_leader: Callable[[], bool] = lambda: True,
        shards: ShardRouter | None = None,
    ) -> None:
        self.engine = engine
        self.shards = shards  # answers to its Reclaims go there
        self.role = role
        self.max_model_len = max_model_len
        self.is_leader = is_leader

    def epoch(self) -> int:
        return self.role.epoch

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        if not self.is_leader():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this scheduler is a standby, not the leader"
            )
        try:
            first = await asyncio.wait_for(context.read(), HELLO_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no FrontendHello in time")
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message on a front-end link must be FrontendHello",
            )
        hello = first.hello
        if hello.epoch > self.epoch():
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"a newer leader (epoch {hello.epoch}) exists; this one has epoch {self.epoch()}",
            )
        session = FrontendSession(hello, self.epoch)
        engine = self.engine
        old = engine.frontends.get(session.frontend_id)
        if old is not None:
            self._gone(old, "replaced by a new connection with the same front-end id")
        engine.frontends[session.frontend_id] = session
        resumed = [self._build(msg, session) for msg in self._own(hello.in_flight, session)]
        resumed_ok = [s for s in resumed if s is not None]
        num_adopted = engine.resume(resumed_ok)
        for state in resumed_ok:
            session.request_ids.add(state.request_id)
        session.send(
            pb.LeaderMessage(
                hello_ack=pb.FrontendHelloAck(
                    scheduler_id=self.role.scheduler_id,
                    num_resumed=len(resumed_ok),
                    num_adopted=num_adopted,
                )
            )
        )
        log.info(
            "frontend_attached",
            frontend_id=session.frontend_id,
            host=session.host,
            resumed=len(resumed_ok),
            adopted=num_adopted,
        )
        reader = asyncio.create_task(self._read(context, session))
        status = asyncio.create_task(self._status(session))
        try:
            while (message := await session.outbox.get()) is not None:
                await context.write(message)
        finally:
            reader.cancel()
            status.cancel()
            self._gone(session, "stream ended")

    def _own(self, in_flight, session: FrontendSession) -> list[pb.SubmitRequest]:
        """The hello's requests this front-end may resume: not one in flight from another
        front-end or client (its id would take that request over), and each id once. The
        others end on this front-end with an error; the request they name is untouched."""
        mine: dict[str, pb.SubmitRequest] = {}
        for msg in in_flight:
            owner = self.engine.owner(msg.request_id)
            if msg.request_id in mine or (owner is not None and owner != session.frontend_id):
                log.warning(
                    "resume_refused",
                    frontend_id=session.frontend_id,
                    request_id=msg.request_id,
                    reason="in flight from another client" if owner else "listed twice",
                )
                session.add_update(
                    msg.request_id,
                    0,
                    [],
                    FinishReason.ERROR,
                    error=f"request id {msg.request_id!r} is in flight from another client",
                    error_code="ALREADY_EXISTS",
                )
                continue
            mine[msg.request_id] = msg
        return list(mine.values())

    def _build(self, msg: pb.SubmitRequest, session: FrontendSession) -> InFlightRequest | None:
        try:
            return from_submit(msg, session, session.frontend_id)
        except RequestRejected as exc:
            session.add_update(
                msg.request_id,
                0,
                [],
                FinishReason.ERROR,
                error=str(exc),
                error_code=error_code(exc),
            )
            return None

    async def _read(self, context, session: FrontendSession) -> None:
        engine = self.engine
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    break
                kind = msg.WhichOneof("msg")
                if kind == "submit":
                    self._submit(msg.submit, session)
                elif kind == "cancel":
                    request_id = msg.cancel.request_id
                    if request_id in session.request_ids:  # another front-end's: not this one's
                        session.request_ids.discard(request_id)
                        engine.drop(request_id)
                elif kind == "resubmit" and self.shards is not None:
                    if msg.resubmit.request_id in session.request_ids:
                        self.shards.reclaimed(msg.resubmit)
        except Exception as exc:  # noqa: BLE001 - any stream failure means the front-end is gone
            log.info("frontend_stream_error", frontend_id=session.frontend_id, error=str(exc))
        session.close()

    def _submit(self, msg: pb.SubmitRequest, session: FrontendSession) -> None:
        state = self._build(msg, session)
        if state is None:
            return
        try:
            self.engine.submit(state)
        except RequestRejected as exc:
            code = error_code(exc)
            self.engine.observer.on_request_rejected(
                "overloaded" if code == "RESOURCE_EXHAUSTED" else "invalid"
            )
            session.add_update(
                msg.request_id,
                0,
                [],
                FinishReason.ERROR,
                error=str(exc),
                error_code=code,
                retry_after_s=getattr(exc, "retry_after_s", 0.0) or 0.0,
            )
            return
        session.request_ids.add(state.request_id)

    async def _status(self, session: FrontendSession) -> None:
        while not session.closed:
            session.send(
                pb.LeaderMessage(status=cluster_status(self.engine, self.role, self.max_model_len))
            )
            await asyncio.sleep(STATUS_INTERVAL_S)

    def _gone(self, session: FrontendSession, reason: str) -> None:
        session.close()
        engine = self.engine
        if engine.frontends.get(session.frontend_id) is session:
            del engine.frontends[session.frontend_id]
        for request_id in list(session.request_ids):
            state = engine.requests.get(request_id)
            if isinstance(state, InFlightRequest) and state.sink is session:
                engine.drop(request_id)
        session.request_ids.clear()
        log.info("frontend_detached", frontend_id=session.frontend_id, reason=reason)

    async def SetPriority(self, request, context):  # noqa: N802
        caller = dict(context.invocation_metadata() or ()).get(FRONTEND_ID_METADATA, "")
        owner = self.engine.owner(request.request_id)
        if owner is not None and owner != caller:  # as if unknown: ids of others stay hidden
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} from this front-end"
            )
        try:
            set_priority(self.engine, request.request_id, request.priority)
        except PriorityChangeError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        return gen_pb.SetPriorityResponse()
