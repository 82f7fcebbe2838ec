"""gRPC adapter for workers: registration, the Step/StepResult exchange, liveness."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from common.convert import HandleTable, decode_step_result, encode_step
from common.logging import get_logger
from common.pb import worker_link_pb2 as pb
from common.pb import worker_link_pb2_grpc as pb_grpc
from scheduler_svc.core import SchedulerOutput
from scheduler_svc.core.preemption_cost import WorkerCosts
from scheduler_svc.engine import worker_limits
from scheduler_svc.engine.lora_registry import adapter_from_message
from scheduler_svc.engine.serving_engine import ServingEngine
from scheduler_svc.engine.worker_session import (
    HeldRequest,
    StepReply,
    WorkerLost,
    WorkerRegistration,
    WorkerSession,
)

log = get_logger("splitserve.worker_link")
REGISTER_TIMEOUT_S = 30.0


class GrpcWorkerTransport:
    """One worker's stream: write a Step (stamped with the leader's epoch), wait for its
    StepResult; watch for silence."""

    def __init__(
        self,
        context: grpc.aio.ServicerContext,
        timeout_s: float,
        vocab_size: int,
        epoch: int = 0,
    ) -> None:
        self.context = context
        self.vocab_size = vocab_size  # the scheduler's own, never what the worker declared
        self.epoch = epoch
        self.timeout_s = timeout_s
        self.handles = HandleTable()
        self.last_heard = time.monotonic()
        self.pending: dict[int, asyncio.Future] = {}  # step id -> future of its StepResult
        self.finished_handles: dict[int, list[int]] = {}  # step id -> handles it finished
        self.session: WorkerSession | None = None
        self.on_drain = None  # callable(timeout_s), set once attached
        self.on_lora_report = None  # callable(LoraReport), set once attached
        self.lost_reason = ""
        # a LoRA command may be written while a step is: one write on the stream at a time
        self._write_lock = asyncio.Lock()

    async def submit(self, out: SchedulerOutput) -> asyncio.Future:
        """Send a step; returns the future of its raw result (steps may be pipelined)."""
        if self.lost_reason:
            raise WorkerLost(self.lost_reason)
        message = pb.SchedulerMessage()
        encode_step(out, self.handles, release=False, into=message.step, epoch=self.epoch)
        if message.step.finished:
            self.finished_handles[out.step_id] = list(message.step.finished)
        future = asyncio.get_running_loop().create_future()
        self.pending[out.step_id] = future
        try:
            async with self._write_lock:
                await self.context.write(message)
        except Exception as exc:  # the stream is gone
            self.lose(f"write failed: {exc}")
        return future

    async def send_lora(self, name: str, path: str, unload: bool) -> None:
        """Tell the worker to read (in the background) or drop a LoRA adapter; its LoraReport
        comes back on the stream (on_lora_report)."""
        if self.lost_reason:
            raise WorkerLost(self.lost_reason)
        command = pb.LoraCommand(name=name, path=path, unload=unload)
        async with self._write_lock:
            await self.context.write(pb.SchedulerMessage(lora_command=command))

    async def result(self, out: SchedulerOutput, future: asyncio.Future) -> StepReply:
        """Wait for a submitted step's result and check it against the step's shape and the
        model's vocabulary: a wrong answer loses the worker with none of it applied, so its
        requests move on carrying only tokens that were checked."""
        result: pb.StepResult = await future
        if result.error:
            raise WorkerLost(f"worker failed a step: {result.error}")
        if result.resident_loras_changed and self.session is not None:
            self.session.resident_loras = set(result.resident_loras)
        try:  # also checks each request got at most one token, inside the vocabulary
            sampled, logprobs = decode_step_result(
                result, self.handles, self.vocab_size, out.spec_token_ids
            )
        except ValueError as exc:
            raise WorkerLost(f"worker answered a step wrongly: {exc}") from exc
        expected = out.num_scheduled_tokens.keys()
        if sampled.keys() != expected:
            raise WorkerLost(
                f"worker answered for {len(sampled)} requests, {len(expected)} were scheduled"
            )
        # no later result can name them now
        self.handles.release_handles(self.finished_handles.pop(out.step_id, ()))
        return StepReply(
            sampled, logprobs, result.forward_time_s, result.step_time_s, result.idle_time_s
        )

    async def execute(self, out: SchedulerOutput) -> StepReply:
        return await self.result(out, await self.submit(out))

    def lose(self, reason: str) -> None:
        if not self.lost_reason:
            self.lost_reason = reason
        for future in self.pending.values():
            if not future.done():
                future.set_exception(WorkerLost(reason))
                future.add_done_callback(lambda f: f.exception())  # awaited or not: handled
        self.pending.clear()
        if self.session is not None:
            self.session.mark_lost(reason)

    async def read_loop(self) -> None:
        try:
            while True:
                msg = await self.context.read()
                if msg is grpc.aio.EOF:
                    break
                self.last_heard = time.monotonic()
                kind = msg.WhichOneof("msg")
                if kind == "drain" and self.on_drain is not None:
                    self.on_drain(msg.drain.timeout_s)
                elif kind == "lora_report" and self.on_lora_report is not None:
                    self.on_lora_report(msg.lora_report)
                elif kind == "step_result":
                    future = self.pending.pop(msg.step_result.step_id, None)
                    if future is None or future.done():
                        self.lose(f"unexpected step result {msg.step_result.step_id}")
                        return
                    future.set_result(msg.step_result)
        except Exception as exc:  # noqa: BLE001 - any stream failure means the worker is gone
            self.lose(f"stream error: {exc}")
            return
        self.lose("worker closed its stream")

    async def watchdog(self) -> None:
        while not self.lost_reason:
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            silent = time.monotonic() - self.last_heard
            if silent > self.timeout_s:
                self.lose(f"no answer or heartbeat for {silent:.1f} s")


def check_registration(
    reg: pb.Register, model_name: str, vocab_size: int
) -> tuple[grpc.StatusCode, str] | None:
    if reg.model and reg.model != model_name:
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"worker serves model {reg.model!r} but this scheduler serves {model_name!r}",
        )
    if reg.vocab_size != vocab_size:  # another model, or none stated: its ids mean nothing here
        return (
            grpc.StatusCode.INVALID_ARGUMENT,
            f"worker's model has a vocabulary of {reg.vocab_size} tokens but this scheduler's "
            f"{model_name} has {vocab_size}; start the worker with the scheduler's --model",
        )
    if reg.block_size < 1 or reg.block_size > 1024:
        return grpc.StatusCode.INVALID_ARGUMENT, f"impossible block size {reg.block_size}"
    if reg.num_device_blocks < 1:
        return grpc.StatusCode.INVALID_ARGUMENT, "worker registered with no KV cache blocks"
    if reg.num_device_blocks > 50_000_000 or reg.num_host_blocks > 50_000_000:
        return grpc.StatusCode.INVALID_ARGUMENT, "worker registered an impossible block count"
    if reg.max_model_len < 2:
        return grpc.StatusCode.INVALID_ARGUMENT, f"impossible max_model_len {reg.max_model_len}"
    return None


def held_requests(reg: pb.Register) -> list[HeldRequest]:
    return [
        HeldRequest(h.request_id, list(h.block_ids), h.num_computed_tokens, h.num_tokens)
        for h in reg.held
    ]


class WorkerLinkService(pb_grpc.WorkerLinkServicer):
    """Workers' streams into the engine. `epoch` is the leader's fencing token, stamped on the
    RegisterAck and every Step (0: a single scheduler without etcd)."""

    def __init__(self, engine: ServingEngine, epoch: Callable[[], int] = lambda: 0) -> None:
        self.engine = engine
        self.epoch = epoch
        self._counter = 0

    async def Connect(self, request_iterator, context: grpc.aio.ServicerContext):  # noqa: N802
        try:
            first = await asyncio.wait_for(context.read(), REGISTER_TIMEOUT_S)
        except TimeoutError:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "no Register message in time")
        if first is grpc.aio.EOF or first.WhichOneof("msg") != "register":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "the first message on a worker link must be Register",
            )
        reg = first.register
        problem = check_registration(reg, self.engine.model_name, self.engine.vocab_size)
        if problem is not None:
            log.warning("worker_refused", reason=problem[1], peer=context.peer())
            await context.abort(*problem)
        epoch = self.epoch()
        if reg.epoch > epoch:  # it follows a newer leader already: this one is fenced
            log.warning("worker_refused", reason="fenced", epoch=epoch, worker_epoch=reg.epoch)
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, f"a newer leader (epoch {reg.epoch}) exists"
            )
        self._counter += 1
        worker_id = reg.worker_id or f"worker-{self._counter}"
        transport = GrpcWorkerTransport(
            context, self.engine.config.worker_timeout, self.engine.vocab_size, epoch
        )
        registration = WorkerRegistration(
            worker_id=worker_id,
            model=reg.model,
            block_size=reg.block_size,
            num_device_blocks=reg.num_device_blocks,
            num_host_blocks=reg.num_host_blocks,
            max_model_len=reg.max_model_len,
            address=context.peer(),
            costs=WorkerCosts.from_message(reg),
            kernels=reg.kernels,
            host=reg.host,
            pid=reg.pid,
            epoch=reg.epoch,
            held=held_requests(reg),
            max_num_seqs=reg.max_num_seqs,
            max_num_batched_tokens=reg.max_num_batched_tokens,
            max_loras=reg.max_loras,
            max_lora_rank=reg.max_lora_rank,
            loras=[adapter_from_message(a) for a in reg.loras],
            resident_loras=list(reg.resident_loras),
        )
        refused = worker_limits.check(self.engine.config, registration)
        if refused is not None:
            log.warning("worker_refused", reason=refused, peer=context.peer())
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        limits = worker_limits.WorkerLimits.of(self.engine.config, registration)
        await context.write(
            pb.SchedulerMessage(
                register_ack=pb.RegisterAck(
                    worker_id=worker_id,
                    max_model_len=limits.max_model_len.value,
                    epoch=epoch,
                )
            )
        )
        session = self.engine.attach(registration, transport)
        transport.session = session
        transport.on_drain = lambda timeout_s: self.engine.start_drain(session, timeout_s)
        transport.on_lora_report = lambda report: self.engine.loras.on_report(session, report)
        tasks = [
            asyncio.create_task(transport.read_loop()),
            asyncio.create_task(transport.watchdog()),
        ]
        try:
            try:
                await self.engine.run_worker(session)
            except Exception as exc:  # a bug of ours: said, and the worker's requests move on
                log.exception("step_loop_failed", worker_id=worker_id)
                session.mark_lost(f"the step loop failed: {type(exc).__name__}: {exc}")
                raise
            if session.draining and not session.lost:
                handed_back = self.engine.finish_drain(session)
                drained = pb.Drained(
                    num_finished=session.num_drained_finished, num_handed_back=handed_back
                )
                await context.write(pb.SchedulerMessage(drained=drained))
                log.info(
                    "worker_drained",
                    worker_id=worker_id,
                    handed_back=handed_back,
                    finished=session.num_drained_finished,
                )
        finally:
            for task in tasks:
                task.cancel()
            reason = session.lost_reason or transport.lost_reason or "drained"
            self.engine.detach(session, reason)
