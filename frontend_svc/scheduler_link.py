"""The front-end's side of the FrontendLink: the engine the client APIs talk to, in a process
apart from the scheduler.

It keeps every request in flight with the tokens its client already has, sends tokenized
requests to the leader scheduler and applies the token batches that come back (the request's
own detokenizer and stop strings run here). When the leader is lost it finds the next one
(etcd, or the same fixed address), says hello with everything in flight, and the streams go on
from the first token the client has not seen: `start` on each update makes a token that arrives
twice land once. A leader message from an older epoch than one already accepted is refused.
Without a leader for `leader_wait_timeout` seconds, requests in flight fail with UNAVAILABLE
and new ones are refused at once until a leader answers again. The leader's internal port is
dialled as `tls` says (frontend_svc/link_tls.py): mutual TLS, or plaintext on loopback.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from common.convert import FINISH_FROM_PB, TokenLogprobs, sampling_to_proto
from common.link_auth import FRONTEND_ID_METADATA
from common.logging import get_logger
from common.outcomes import LoraAdapterError, PriorityChangeError
from common.pb import frontend_link_pb2 as pb
from common.pb import frontend_link_pb2_grpc as pb_grpc
from common.pb import generation_pb2 as gen_pb
from frontend_svc.client_request import ClientRequest
from frontend_svc.client_streams import ClientStreams
from frontend_svc.leader_finder import LeaderFinder
from frontend_svc.link_tls import LinkTls
from frontend_svc.observer import FrontendObserver

log = get_logger("splitserve.frontend")

HELLO_ACK_TIMEOUT_S = 10.0
LORA_CALL_TIMEOUT_S = 150.0  # the leader waits up to 120 s for its workers to read an adapter


@dataclass(slots=True)
class FrontendIdentity:
    frontend_id: str
    host: str
    pid: int
    http_address: str = ""
    grpc_address: str = ""


class SchedulerLink:
    """The SchedulerClient of a front-end process apart (frontend_svc/client_streams.py)."""

    def __init__(
        self,
        identity: FrontendIdentity,
        model_name: str,
        finder: LeaderFinder,
        leader_wait_timeout: float = 15.0,
        max_message_bytes: int = 256 * 1024 * 1024,
        tls: LinkTls | None = None,
    ) -> None:
        self.identity = identity
        self.model_name = model_name
        self.finder = finder
        self.leader_wait_timeout = leader_wait_timeout
        self.max_message_bytes = max_message_bytes
        self.tls = tls or LinkTls()  # how the leader's internal port is dialled
        self.observer = FrontendObserver()
        self.observer.watch_leader(model_name, lambda: self.server_info(0))
        self.streams = ClientStreams(self.observer)
        self.requests = self.streams.requests
        self.status: pb.ClusterStatus | None = None
        self.epoch = 0
        self.leader_address = ""
        self.connected = asyncio.Event()
        self.num_leader_changes = 0
        self._outbox: asyncio.Queue[pb.FrontendMessage] | None = None
        self._outage_since: float | None = time.monotonic()
        self._outage_failed = False
        self._task: asyncio.Task | None = None
        self._call: Any = None

    # ---- what the client APIs call --------------------------------------------------------
    def submit(self, state: ClientRequest) -> None:
        self.streams.add(state)
        if self._outage_failed:
            self._fail(state, self._outage_sentence())
            return
        if self._outbox is not None and self.connected.is_set():
            self._outbox.put_nowait(pb.FrontendMessage(submit=self._submit_message(state)))

    def drop(self, request_id: str) -> None:
        """The client went away: tell the leader to free everything."""
        if self.requests.pop(request_id, None) is not None:
            self._cancel(request_id)

    def abort(self, request_id: str) -> bool:
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        state.end_aborted()
        self._cancel(request_id)
        return True

    async def change_priority(self, request_id: str, priority: int) -> None:
        if not self.connected.is_set():
            raise PriorityChangeError("UNAVAILABLE", self._outage_sentence())
        async with self.tls.channel(self.leader_address) as channel:
            stub = pb_grpc.FrontendLinkStub(channel)
            try:
                await stub.SetPriority(
                    gen_pb.SetPriorityRequest(request_id=request_id, priority=priority),
                    timeout=5.0,
                    metadata=((FRONTEND_ID_METADATA, self.identity.frontend_id),),
                )
            except grpc.aio.AioRpcError as exc:
                raise PriorityChangeError(exc.code().name, exc.details()) from None

    def lora_adapters(self) -> list[gen_pb.LoraAdapter]:
        status = self.status
        return [] if status is None else list(status.server_info.loras)

    async def load_lora_adapter(self, name: str, path: str) -> gen_pb.LoraAdapter:
        request = pb.LoadLoraAdapterRequest(lora_name=name, lora_path=path)
        adapter = await self._lora_call("LoadLoraAdapter", request)
        if self.status is not None:  # served here at once, not from the next status on
            self.status.server_info.loras.append(adapter)
        return adapter

    async def unload_lora_adapter(self, name: str) -> int:
        request = pb.UnloadLoraAdapterRequest(lora_name=name)
        in_flight = (await self._lora_call("UnloadLoraAdapter", request)).num_in_flight
        if self.status is not None:
            loras = self.status.server_info.loras
            kept = [a for a in loras if a.name != name]
            del loras[:]
            loras.extend(kept)
        return in_flight

    async def _lora_call(self, method: str, request):
        if not self.connected.is_set():
            raise LoraAdapterError("UNAVAILABLE", self._outage_sentence())
        async with self.tls.channel(self.leader_address) as channel:
            call = getattr(pb_grpc.FrontendLinkStub(channel), method)
            try:
                return await call(
                    request,
                    timeout=LORA_CALL_TIMEOUT_S,
                    metadata=((FRONTEND_ID_METADATA, self.identity.frontend_id),),
                )
            except grpc.aio.AioRpcError as exc:
                raise LoraAdapterError(exc.code().name, exc.details()) from None

    def server_info(self, max_model_len: int) -> gen_pb.ServerInfo | None:
        """The leader's ServerInfo as of its last status; None while no leader answers."""
        if not self.connected.is_set() or self.status is None:
            return None
        return self.status.server_info

    def live_workers(self) -> list[str]:
        """The leader's workers that take requests, as of its last status (for /ready)."""
        if not self.connected.is_set() or self.status is None:
            return []
        return [
            w.worker_id
            for w in self.status.server_info.workers
            if w.state not in ("lost", "draining")
        ]

    # ---- the link -------------------------------------------------------------------------
    async def start(self) -> None:
        await self.finder.start()
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        for state in list(self.requests.values()):
            self._fail(state, "the front-end is shutting down; retry later")
        await self.finder.stop()

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            wait = self._outage_left()
            leader = await self.finder.next_leader(self.epoch, wait)
            if leader is None:
                self._check_outage()
                continue
            address, epoch = leader
            # a frozen leader accepts connections and answers nothing: the session ends as
            # soon as a newer leader is named, whatever it was waiting on
            session = asyncio.create_task(self._session(address))
            newer = asyncio.create_task(self.finder.wait_newer(epoch))
            try:
                done, _ = await asyncio.wait({session, newer}, return_when=asyncio.FIRST_COMPLETED)
                if session in done:
                    session.result()
                    backoff = 0.05
                else:
                    log.info("leader_changed", old_epoch=epoch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - any failure: find the leader again
                log.info("leader_link_lost", address=address, error=_describe(exc))
            finally:
                for task in (session, newer):
                    task.cancel()
                await asyncio.gather(session, newer, return_exceptions=True)
            if self.connected.is_set():
                self.connected.clear()
            if self._outage_since is None:
                self._outage_since = time.monotonic()
            self._check_outage()
            # until etcd names a newer leader, the old key still points at the dead one: retry
            # it with backoff, but go at once when the new one is named
            try:
                await asyncio.wait_for(self.finder.wait_newer(epoch), backoff)
            except TimeoutError:
                pass
            backoff = min(0.5, backoff * 2)

    async def _session(self, address: str) -> None:
        options = [
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", 5_000),
        ]
        async with self.tls.channel(address, options) as channel:
            call = pb_grpc.FrontendLinkStub(channel).Connect()
            self._call = call
            outbox: asyncio.Queue[pb.FrontendMessage] = asyncio.Queue()
            ident = self.identity
            hello = pb.FrontendHello(
                frontend_id=ident.frontend_id,
                host=ident.host,
                pid=ident.pid,
                http_address=ident.http_address,
                grpc_address=ident.grpc_address,
                epoch=self.epoch,
                in_flight=[self._submit_message(s) for s in self.requests.values()],
            )
            await call.write(pb.FrontendMessage(hello=hello))
            first = await asyncio.wait_for(call.read(), HELLO_ACK_TIMEOUT_S)
            if first is grpc.aio.EOF or first.WhichOneof("msg") != "hello_ack":
                raise ConnectionError("the scheduler did not answer FrontendHello")
            if first.epoch < self.epoch:
                raise ConnectionError(f"fenced: epoch {first.epoch} < {self.epoch}")
            if first.epoch != self.epoch or address != self.leader_address:
                self.num_leader_changes += 1
                self.observer.leader_changes.inc()
            self.epoch = first.epoch
            self.observer.epoch.set(self.epoch)
            self.leader_address = address
            self._since_hello(hello, outbox)
            self._outbox = outbox
            self._outage_since = None
            self._outage_failed = False
            self.connected.set()
            ack = first.hello_ack
            log.info(
                "leader_connected",
                address=address,
                epoch=self.epoch,
                scheduler_id=ack.scheduler_id,
                resumed=ack.num_resumed,
                adopted=ack.num_adopted,
            )
            writer = asyncio.create_task(self._write(call, outbox))
            reader = asyncio.create_task(self._read(call))
            try:
                done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # raises what ended the stream
            finally:
                self._outbox = None
                self._call = None
                writer.cancel()
                reader.cancel()
                call.cancel()

    def _since_hello(self, hello: pb.FrontendHello, outbox: asyncio.Queue) -> None:
        """What changed while the hello waited for its ack, which no message carried: a request
        that came meanwhile would wait here forever, one whose client left would run on."""
        sent = {msg.request_id for msg in hello.in_flight}
        for state in self.requests.values():
            if state.request_id not in sent:
                outbox.put_nowait(pb.FrontendMessage(submit=self._submit_message(state)))
        for request_id in sent - self.requests.keys():
            outbox.put_nowait(pb.FrontendMessage(cancel=pb.CancelRequest(request_id=request_id)))

    async def _write(self, call, outbox: asyncio.Queue) -> None:
        while True:
            await call.write(await outbox.get())

    async def _read(self, call) -> None:
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            if msg.epoch < self.epoch:  # fencing: a deposed leader's words count for nothing
                log.warning("fenced_message", epoch=msg.epoch, current=self.epoch)
                return
            kind = msg.WhichOneof("msg")
            if kind == "tokens":
                now = time.monotonic()
                batch = msg.tokens
                if batch.next_request_ids:  # the columns first (frontend_link.proto)
                    self._apply_next(batch, now)
                for update in batch.updates:
                    self._apply(update, now)
            elif kind == "status":
                self.status = msg.status
                self.streams.set_stream_interval(msg.status.stream_interval)
            elif kind == "reclaim":
                self._reclaim(msg.reclaim.request_ids)

    def _apply_next(self, batch: pb.TokenBatch, now: float) -> None:
        """One more token for each request of the columns; each goes on."""
        apply_next = self.streams.apply_next
        for request_id, start, token_id in zip(
            batch.next_request_ids, batch.next_starts, batch.next_token_ids, strict=True
        ):
            if apply_next(request_id, start, token_id, now):
                self._cancel(request_id)

    def _apply(self, update: pb.RequestUpdate, now: float) -> None:
        logprobs = None
        if update.logprobs:
            logprobs = [
                TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
                for lp in update.logprobs
            ]
        ended_here = self.streams.apply(
            update.request_id,
            update.start,
            list(update.token_ids),
            FINISH_FROM_PB.get(update.finish_reason),
            update.stop_reason,
            logprobs,
            update.error,
            update.error_code,
            update.worker_id,
            now,
        )
        if ended_here:
            self._cancel(update.request_id)

    # ---- helpers --------------------------------------------------------------------------
    def _submit_message(self, state: ClientRequest) -> pb.SubmitRequest:
        now = time.monotonic()
        deadline_left = 0.0
        if state.deadline is not None:
            deadline_left = max(1e-3, state.deadline - now)
        return pb.SubmitRequest(
            request_id=state.request_id,
            prompt_token_ids=state.prompt_token_ids,
            sampling=sampling_to_proto(state.params),
            priority=state.priority,
            tenant=state.tenant or "",
            deadline_left_s=deadline_left,
            output_token_ids=state.output_token_ids,
            num_migrations=state.num_migrations,
            age_s=max(0.0, now - state.arrival_time),
            eos_token_id=-1 if state.eos_token_id is None else state.eos_token_id,
            prefill_after=state.prefill_after or "",
            ttft_target_s=state.ttft_target_s or 0.0,
            tpot_target_s=state.tpot_target_s or 0.0,
            lora_name=state.lora_name,
        )

    def _reclaim(self, request_ids) -> None:
        """The leader lost the step shard that ran these: each one still in flight here goes
        back with the tokens its client has; the others it may forget."""
        if self._outbox is None:
            return
        for request_id in request_ids:
            state = self.requests.get(request_id)
            if state is None:
                self._cancel(request_id)
            else:
                self._outbox.put_nowait(pb.FrontendMessage(resubmit=self._submit_message(state)))

    def _cancel(self, request_id: str) -> None:
        if self._outbox is not None and self.connected.is_set():
            self._outbox.put_nowait(
                pb.FrontendMessage(cancel=pb.CancelRequest(request_id=request_id))
            )

    def _outage_left(self) -> float | None:
        if self._outage_since is None or self._outage_failed:
            return None
        return max(0.0, self._outage_since + self.leader_wait_timeout - time.monotonic())

    def _outage_sentence(self) -> str:
        return (
            f"no scheduler leader answered within {self.leader_wait_timeout:g} s; "
            "retry later (splitserve status shows the cluster)"
        )

    def _check_outage(self) -> None:
        """Past the bound without a leader: fail what waits, refuse new ones at once."""
        left = self._outage_left()
        if left is None or left > 0:
            return
        self._outage_failed = True
        log.warning("no_leader", waited_s=self.leader_wait_timeout, failed=len(self.requests))
        self.streams.fail_all(self._outage_sentence(), "UNAVAILABLE")

    def _fail(self, state: ClientRequest, sentence: str) -> None:
        self.streams.fail(state, sentence, "UNAVAILABLE")


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"
