"""gRPC adapter for clients: Generate (server streaming), Abort, GetServerInfo."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from common.convert import FINISH_TO_PB
from common.logging import get_logger
from common.outcomes import PriorityChangeError, RequestRejected, error_code
from common.pb import generation_pb2 as pb
from common.pb import generation_pb2_grpc as pb_grpc
from frontend_svc.client_request import ClientRequest, StreamDelta
from frontend_svc.client_streams import SchedulerClient
from frontend_svc.intake import Intake

log = get_logger("splitserve.generation")


def delta_to_proto(request_id: str, prompt_tokens: int, delta: StreamDelta) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=request_id,
        token_ids=delta.token_ids,
        text=delta.text,
        finish_reason=FINISH_TO_PB[delta.finish_reason],
        stop_reason="" if delta.stop_reason is None else str(delta.stop_reason),
        prompt_tokens=prompt_tokens,
        completion_tokens=delta.num_output_tokens,
        error=delta.error,
        worker_id=delta.worker_id,
    )
    for lp in delta.logprobs or ():
        entry = msg.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
        for tok, value in lp.top:
            entry.top.add(token_id=tok, logprob=value)
    return msg


async def _one(state: ClientRequest) -> AsyncIterator[tuple[int, StreamDelta]]:
    queue = state.queue
    while True:
        delta = queue.take_merged(await queue.get())
        yield 0, delta
        if delta.finish_reason is not None or delta.error_code:
            return


async def _interleaved(states: list[ClientRequest]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Each sample's deltas as they come, tagged with its index, until every sample ended."""
    waiting = {asyncio.ensure_future(s.queue.get()): i for i, s in enumerate(states)}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=waiting.__getitem__):
                index = waiting.pop(future)
                delta = states[index].queue.take_merged(future.result())
                yield index, delta
                if delta.error_code:
                    return
                if delta.finish_reason is None:
                    waiting[asyncio.ensure_future(states[index].queue.get())] = index
    finally:
        for future in waiting:
            future.cancel()


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, scheduler: SchedulerClient, intake: Intake) -> None:
        self.scheduler = scheduler
        self.intake = intake
        self._groups: dict[str, list[str]] = {}  # n > 1 in flight: the first id -> all ids

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        submitted: list[ClientRequest] = []
        try:
            # tokenizing (and compiling a grammar) beside the event loop: other streams go on
            group = await asyncio.to_thread(self.intake.build_group, request)
            for state in group:
                self.scheduler.submit(state)
                submitted.append(state)
        except RequestRejected as exc:
            for state in submitted:  # a group is accepted whole or not at all
                self.scheduler.drop(state.request_id)
            code = error_code(exc)
            self.scheduler.observer.on_request_rejected(
                "overloaded" if code == "RESOURCE_EXHAUSTED" else "invalid"
            )
            retry_after = getattr(exc, "retry_after_s", None)
            if retry_after is not None:
                context.set_trailing_metadata((("retry-after", f"{retry_after:.1f}"),))
            await context.abort(getattr(grpc.StatusCode, code), str(exc))
        first = submitted[0]
        request_id = first.request_id
        prompt_tokens = len(first.prompt_token_ids)
        log.info(
            "request_accepted",
            request_id=request_id,
            prompt_tokens=prompt_tokens,
            max_tokens=first.params.max_tokens,
            samples=len(submitted),
            worker_id=first.worker_id,
        )
        if request.echo_prompt_token_ids:
            yield pb.GenerateResponse(
                request_id=request_id,
                prompt_token_ids=first.prompt_token_ids,
                prompt_tokens=prompt_tokens,
            )
        if len(submitted) > 1:
            self._groups[request_id] = [s.request_id for s in submitted]
        try:
            deltas = _one(first) if len(submitted) == 1 else _interleaved(submitted)
            async for index, delta in deltas:
                if delta.error_code:
                    await context.abort(getattr(grpc.StatusCode, delta.error_code), delta.error)
                msg = delta_to_proto(request_id, prompt_tokens, delta)
                msg.index = index
                yield msg
                if delta.finish_reason is not None:
                    log.info(
                        "request_finished",
                        request_id=submitted[index].request_id,
                        finish_reason=str(delta.finish_reason),
                        output_tokens=delta.num_output_tokens,
                        worker_id=delta.worker_id,
                    )
        finally:
            self._groups.pop(request_id, None)
            for state in submitted:
                if not state.finished:  # client cancelled or disconnected
                    log.info("request_cancelled", request_id=state.request_id)
                    self.scheduler.drop(state.request_id)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        ids = self._groups.get(request.request_id, [request.request_id])
        if not [request_id for request_id in ids if self.scheduler.abort(request_id)]:
            await context.abort(
                grpc.StatusCode.NOT_FOUND, f"no request {request.request_id!r} is in flight"
            )
        return pb.AbortResponse()

    async def SetPriority(self, request: pb.SetPriorityRequest, context):  # noqa: N802
        try:
            await self.scheduler.change_priority(request.request_id, request.priority)
        except PriorityChangeError as exc:
            await context.abort(getattr(grpc.StatusCode, exc.code), str(exc))
        log.info("priority_changed", request_id=request.request_id, priority=request.priority)
        return pb.SetPriorityResponse()

    async def GetServerInfo(self, request, context):  # noqa: N802
        info = self.scheduler.server_info(self.intake.max_model_len)
        if info is None:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "no scheduler leader is connected; retry later"
            )
        return info
